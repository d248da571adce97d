"""Tests of the serving engine, its model and its speculation."""
