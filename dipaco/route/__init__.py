"""Documents to paths: `dipaco route` (features -> k-means, assign), the shards each path trains on, the
router artifact and the provenance of a run's routing. Re-routing from trained paths is dipaco.train.reroute."""
