"""The retraining side: offline drafter training (`training/`) and evaluation (`evaluation/`), the
`specloop` command line root and `specloop up`."""
