"""The JAX program of one replica: what it trains (`task`, `tasks`, `models`), on which data
(`data`, `tokens`), how (`step`, `optim`, `sharding`), and the bitwise digest of its state
(`digest`). Nothing here knows about peers, quorums or failures: that is ftjax.runtime.
"""
