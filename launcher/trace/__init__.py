"""`shoal trace merge|summary|plot`: the job view over the ranks' profiler traces."""
