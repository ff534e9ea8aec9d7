"""Storage: the one place anything durable lives, an fsspec-backed storage root. Knows no Ray."""
