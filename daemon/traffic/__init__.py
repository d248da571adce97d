"""Client-side traffic for the demo: consented requests sent to a running engine."""
