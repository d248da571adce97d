"""The retraining loop: policy, runs, gate, promotion, rollback, scheduling."""
