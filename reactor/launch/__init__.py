"""The launch layer: how a graph becomes processes (and, with the daemons, processes on hosts).

- ``_app``: load an app file and build its graph from a config.
- ``_groups``, ``_placement``, ``_policies``: which process runs which reactor instance.
- ``_runtime``: ``run(graph, placement=...)``, the single-process driver, run ids; ``_result``: ``RunResult``.
- ``_coordinator``, ``_worker``: a multi-process run's lifecycle and its worker processes
  (``python -m reactor.launch._worker``; ``_outbox``: a worker's queue to its peers, ``_leaving``: how it
  leaves with its parent or past its bound); ``_session``: the coordinator's supervision of a run to its
  end, ``_restarts``: its restart policies, ``_localworkers``: its workers on this host, started and
  reaped; ``_protocol``: the schemas of their messages;
  ``_rundir``: the run's private directory and the sweep of dead runs' leftovers.

It sits above the core, the transport and the replay engine, below the nodes and the CLI. The
public names are re-exported by ``reactor`` itself (``reactor.run``, ``reactor.RunResult``).
"""
