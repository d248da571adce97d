"""Tests of the storage package: schema, sink, compaction, dataset builder, erasure."""
