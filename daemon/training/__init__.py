"""Offline drafter work: prompt sets, bootstrap data generation, token sequences, target features,
the trainer and their commands."""
