"""ftjax's benchmarks (`ftjax bench NAME`) and the processes they start. Separate from the library
packages, which never import it: `ftjax.cli.bench` (the dispatcher) imports these modules lazily.

    ftar.py           FTAR bus bandwidth against the raw TCP link (members: ftar_member.py)
    coordinator.py    quorum latency of N simulated replicas against a bare grpcio server
    step.py           FT-HSDP step against synchronous HSDP (sync_baseline.py) and a standalone replica
    catchup.py        catch-up transfer rate against the raw link
    outage.py         step time during an outage against healthy, elastic vs constant global batch
    reduced.py        a reduced-degree replica's step rate against the same replica at full degree
"""
