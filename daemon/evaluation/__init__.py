"""Drafter evaluation: τ by replay over stored target outputs, and by real speculative generation."""
