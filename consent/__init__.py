"""Consent: who agreed to what, and whether one finished request may become a trace.

This package holds the consent registry (SQLite), subject pseudonymization, tenant policies,
PII/secret detectors and the token-id redaction of strip mode, the per-request capture decision,
revocation with erasure, and the admin API and CLI over them. It is not the trace store: rewriting
Parquet belongs to `storage`, and producing traces to Kafka belongs to the engine.
"""
