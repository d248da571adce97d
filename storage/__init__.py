"""Trace storage: schema v1, the Kafka producer, the Parquet sink, compaction, erasure, retention, datasets.

Modules: `schema` (the record and its Arrow shape), `producer` (engine -> Kafka), `sink`
(Kafka -> Parquet), `layout` (paths, durable writes, the live file list), `compaction`, `erasure`,
`erased` (the erased-subjects journal the sink applies), `dataset_copies` (run datasets scrubbed by
subject, expired to their lineage), `expiry` (traces past their tenant's retention), `dataset`
(DuckDB builder), `sequences` (the token sequences trainer and evaluator read, from Parquet or
JSONL), `registry` (the drafter registry contract), `broker` (embedded tansu for development and
tests), `child_process`, `cli`.
"""
