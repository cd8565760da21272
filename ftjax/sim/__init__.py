"""`ftjax simulate`: a discrete-event model of one training job of up to 100K+ GPUs under failures.

- config: the inputs (SimConfig); failures: the failure process (domains, job-level, traces).
- model: the event loop; recovery: the mechanics every strategy shares (stalls, whole-job restarts
  and their policy, checkpoints, units out, spares, slow replicas).
- strategies: sync, ft-hsdp, reduced-degree, replication, spare, diloco, streaming-diloco (with
  --link-gbps, every step pays a ring all-reduce, a DiLoCo step 1/H of one); reduced and checkpoints: pure
  functions they use; closed_form: the analytic means the simulation is checked against.
- presets: the FT-HSDP paper's 100K-GPU job, SPARe's 600K setting, one fed by an `ftjax launch`
  summary; from_run: measure a launched run and predict its ETTR.
- run: averages over seeds and sweeps over any input; plot: the sweep PNG; cli: the command.
"""
