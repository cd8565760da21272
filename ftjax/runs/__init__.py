"""A run directory, read and written: its vocabulary (`events`), its files (`jsonl`), a
replica's lifecycle folded from its records (`lifecycle`), and what a job achieved, computed from
the directory alone (`summary`). The launcher, the coordinator's status page and the simulator's
calibration (`ftjax simulate --from-run`) all read runs through this package.
"""
