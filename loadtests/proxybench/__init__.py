"""The ladder: prefix-router's cost as a proxy, against C, Rust and naive-Python proxies.

    python -m loadtests.proxybench            # every target it can run, every workload
    python -m loadtests.proxybench --install  # first apt-get/pip what is missing
    python -m loadtests.proxybench --targets haproxy,prefix-router --workloads a,b --seconds 5

Contract:
- One run, one machine, the same fast backends (``loadtests.fastbackend``, N
  instances in one process) behind every target in turn.  With two or more CPUs,
  the load generator, the backends and this script run on CPU 0 and the proxy
  under test (with all its processes and threads) on CPU 1, as ``taskset -c``
  would do: children inherit the affinity of the thread that starts them, and
  every thread of a proxy's process tree is pinned again once it is ready.
- Targets, in order (``--targets`` selects; ``direct`` always runs, it is the
  baseline): ``direct`` (no proxy: the ceiling), ``haproxy`` and ``nginx`` (apt),
  ``sglang`` (sglang-router cache_aware), ``vllm-ca`` / ``vllm-ch`` (vllm-router
  cache_aware / consistent_hash) from ``loadtests.peers``, ``aiohttp`` (the
  30-line naive-Python floor below), ``prefix-router`` (PREFIX_AWARE) and
  ``prefix-router-w2`` (the same as ``serve --workers 2``: the supervisor and
  both workers are the proxy's tree, pinned together, or not with
  ``--no-pin``, where every process shares both CPUs).  A
  target that cannot run here is skipped with the reason printed and recorded;
  ``--install`` installs what is missing (apt-get, and the peers' own venv),
  otherwise nothing is installed and what is missing is named.
  Nobody logs per request: HAProxy has no log, nginx ``access_log off``, the
  peers ``--log-level warn`` (sglang-router logs two lines per request at its
  default info), prefix-router ``--access-log off``.
- Workloads (``--workloads``): (a) OpenAI chat, 4 KiB prompt, small non-streaming
  reply; (b) the same with ``stream: true``, 64 SSE chunks; (c) native
  ``/invocations`` with a 64 KiB body; (d) ``--streams`` idle SSE streams (one
  chunk every 5 s) held open at once.  Requests cycle over ``--keys`` distinct
  prompts, each with its own ``x-session-id``, so every target spreads them.
- ``--rounds`` rounds (3) go over every target in turn, each target started
  afresh, so that a burst of outside load spreads over targets instead of
  spoiling one; throughput figures are medians over rounds.  Per round, target
  and workload (a)-(c): a warm-up (``--warmup`` s, not measured), then a
  closed-loop throughput run of ``--seconds`` s with ``--connections``
  keep-alive connections by wrk (a Lua script cycling prebuilt requests; or our
  Python generator with ``--generator python``, or when wrk is missing).  Over
  exactly that run: requests/s, the generator's latency P50/P99, proxy CPU per
  request (utime+stime of every process and thread of the proxy's tree, from
  /proc: the steadiest figure on a noisy machine), how busy the proxy's core
  was, how busy CPU 0 was (generator + backends + this script: near 100 %, the
  client side was the limit, not the proxy), how much CPU other processes took
  meanwhile, peak RSS of the proxy's tree, how requests split over the
  backends, and errors.  Then ``--pause`` s (0.5) idle before the next run.
- Probes, our client, in the last round: (a) paced open loop at
  ``--probe-rate`` (1,000/s) and at ``--probe-fraction`` of direct's (a) rate,
  latency from the moment a request is due; (b) time to first body byte in a
  closed loop on ``--ttfb-connections`` keep-alive connections, each request
  sent as soon as the last ended (where Nagle meets delayed ACKs), the first
  chunk 2 ms after the head.  Added latency = the target's P50/P99 minus
  direct's in the same probe.
- (d), in the last round: RSS of the proxy's tree with no stream, then with
  ``--streams`` streams established (response head and first chunk received by
  every client), as a median of three samples; memory per stream = the
  difference / streams established.
- Output: a markdown table per workload, ratio lines against the best C and the
  best Rust target of this run, prefix-router with 2 workers against 1 (ratios
  of the medians, and the range of the per-round ratios), the warning and error
  lines of prefix-router's logs (and any line that is not JSON) per round, a
  check of prefix-router against the issue's targets, the 1-minute load average
  as each target started, and ``results/proxybench-<time>.json`` with every figure and the
  run's parameters.  Every process is started by this script, stopped by PID
  (SIGTERM, SIGKILL after 5 s) on success, error or Ctrl-C; every loop is
  bounded in time.
- ``python -m loadtests.proxybench floor --listen HOST:PORT --backend URL ...``
  runs the naive aiohttp proxy (the ``aiohttp`` target) on its own;
  ``python -m loadtests.proxybench report results/proxybench-<time>.json``
  prints a saved run's report again.

Modules, one job each (dependencies point down the list):
  __main__   the command line: the run, ``report FILE``, ``floor ...``
  run        the run: backends, rounds over the targets, the JSON document
  measure    one round of one target: throughput, probes, streams; ``combine``
  report     the markdown report of a saved document: tables, ratios, checks
  targets    the proxies: what each routes on, its configuration, its start
  wrk        wrk as the generator: the Lua script, the summary line
  client     our HTTP/1.1 load client: closed loop, paced, held streams
  floor      the naive aiohttp proxy (the ``aiohttp`` target)
  procfs     CPU, RSS and affinity of process trees, from /proc
  workloads  the request bodies of (a)-(d)
Processes are ``loadtests.supervisor`` children; percentiles are
``router.metrics.percentile`` (nearest rank), except wrk's own P50/P99.
"""
