"""Offline drafter work: prompt sets, bootstrap data generation, target features, the trainer and
their commands. The token sequences it reads are `storage/sequences.py`'s."""
