"""Documents to paths: `dipaco route` (features -> k-means, assign), `dipaco reroute` (discriminative), the router loader, and the shards each path trains on."""
