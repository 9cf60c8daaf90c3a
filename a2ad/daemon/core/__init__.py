"""The daemon's decisions as a state machine: jobs, ranks, leases, masks, generations,
rendezvous, grace, re-arm, adoption and the domain protocol.

Events come in as calls (a request with its peer's credentials, a timer, a peer daemon's
message, a process death, a lease connection's end), each at the time given in the
registry's ``now``; decisions go out as effects the caller carries out (replies in
``Registry.outbox``, lease connections to close in ``Registry.closing``, the state to persist
when ``Registry.dirty``, messages through the domain bus) or through the ports of
``ports.py`` (the memory backend, the fd store, the host's process table and descriptors).
Nothing here opens a socket, reads a clock or starts a thread: the daemon (server.py,
fdsock.py, domain.py, keeper.py) turns I/O into these calls, and the simulator
(``python -m a2ad.sim``) drives the same code with fake time and injected faults.

Its modules:

- ``registry.py``: ``Registry``, the one entry point: join, rendezvous, re-arm, recover,
  operator requests, timers, teardown, adoption; it composes its parts, objects with their
  own state and the collaborators they are given: ``leases.py`` (``Leases``: tickets, lease
  connections, pidfds), ``policy.py`` (``LossPolicy``: what a lost rank does by the job's
  policy; re-admission; the active mask) and ``mirror.py`` (``Mirror``: another node's ranks
  as its reports say; a coordinator's rendezvous); ``effects.py`` (``Effects``): the time of
  the event and the effects they share;
- ``jobs.py``: ``Job``, ``RankSlot``, ``Held``: the state; ``JobFacts`` and ``Job.report``:
  a job as plain data for the domain protocol;
- ``federation.py``: the domain protocol: reports, coordinators, decisions, refusals, the
  two-step rendezvous, lost nodes; it reads and changes jobs only through the registry's
  calls by job name;
- ``names.py``: the fd store's names; ``links.py``: a peer node's link states;
  ``ratelog.py``: log lines at a bounded rate; ``ports.py``: the seams above.
"""
