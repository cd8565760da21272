"""`ftjax simulate`: a discrete-event model of one training job of up to 100K+ GPUs under failures.

- model: the inputs (SimConfig), the per-host failure process, the event loop (minutes, work).
- strategies: sync, ft-hsdp, reduced-degree, redundancy: how a failure becomes stalls and lost work.
- closed_form: the analytic means the simulation is checked against.
- presets: the FT-HSDP paper's 100K-GPU job, and one fed by an `ftjax launch` summary.
- run: averages over seeds and the GPU-count sweep; plot: the sweep PNG; cli: the command.
"""
