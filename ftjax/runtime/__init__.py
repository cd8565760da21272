"""The fault-tolerant runtime of one replica: the step protocol's owner (`manager`), the
reference loop (`trainer`), the protocol itself (`protocol`) and its collaborators (averaging
`reduce` over `lanes` and `regions`, catch-up, replay, the watchdog, the replica's hosts in
`host_group`), durable checkpoints, per-step metrics, fault injection, the replica's command
line (`args`), and the process that assembles them (`replica`).
"""
