"""The retraining daemon and the `specloop` command line (the daemon itself is a later issue)."""
