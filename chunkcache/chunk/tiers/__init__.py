"""Chunk KV below the device pool: a provider interface, the local disk and Redis tiers, and the
stack that looks through them on a pool miss and writes newly computed entries down."""
