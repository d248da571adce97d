"""Speculation: the proposer interface, n-gram and DFlash proposers, the DFlash drafter and its artifact, and the
verify rule that decides what a verify pass commits.

Not here: training or evaluating drafters (`daemon/training/`, `daemon/evaluation/`).
"""
