"""Parameter server: manager, shard workers and the staleness inventory."""
