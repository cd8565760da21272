"""The cluster job files of `ftjax launch --emit slurm|k8s` (ftjax/launch/emit.py writes them)."""
