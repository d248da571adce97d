"""specloop tests; packages mirror the source tree so test module names never collide."""
