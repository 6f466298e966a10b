"""Load tests, benchmarks and their harness.  Nothing outside ``loadtests`` imports it.

Every entry point runs one way, from the repository root with the project's
venv: ``python -m loadtests.NAME [--help]``.  Figures and the commands that
produced them: ``loadtests/RESULTS.md``.

Benchmarks (each prints its figures; medians, ratios within one run):
  bench             live: workloads through router or peers to a simulated fleet
  offline           the same routing code against a discrete-event fleet model
  demo              RANDOM vs PREFIX_AWARE on a small simulated fleet (``make demo``)
  proxybench        the proxy ladder: router vs HAProxy, nginx, Rust peers (``make bench-proxy``)
  bench_decision    ns per routing decision: extract, hash, pick (``make bench-decision``)
  bench_cpu         router CPU per request on the ladder's (a), one tree or another (``--tree``)
  bench_hashring    ns per key and keys moved on growth (``make bench-hashring``)
  bench_stall       longest event-loop stall under pathological bodies and admin calls
  bench_membership  start-up cost and loop stall of membership changes
  bench_shared      the shared in-flight table (--workers): ns added per decision, us per fold
  bench_placement_log  one TRAFFIC placement for all processes: ns to record, to apply
  bench_models      model pools: ns per decision with and without models; pool ring vs filtered walk
  bench_responses   Responses API follow-ups: ns to learn an id, to route by it; bytes an id
  bench_admission   the fair admission queue, live: two tenants, one at 10x; TTFT and throughput
  bench_tenants     per-tenant metrics: ns a request, entries and bytes after 100,000 keys
  bench_slowstart   slow start in a live scale event: the minute after an add, with and without
  bench_ab          A/B arms against separate runs of the two configs, live, with ground truth
  bench_restart     restarting under load: stop-then-start against --handover-socket
  bench_handover_loads  a handover at the bound: the old process's streams counted? (--before)
  acceptbench       accept rate with a connection per request, two trees compared
  soak              hours of load with instances killed and faults injected
  attackers         abusive clients beside the soak (soak --attackers): floods, slowloris...
  report            re-print a saved run's tables (``--since`` for the warm part)

Servers the benchmarks start (also runnable alone):
  simserver         simulated vLLM instances: prefix cache, prefill/decode timing
  fastbackend       a near-free OpenAI-shaped responder, the backend of proxybench
  faultproxy        a TCP proxy that delays, cuts and corrupts connections

Library modules:
  supervisor        child processes: start, read a ready line, stop by PID; free_port
  etcd              a real etcd on 127.0.0.1 (bench --share etcd, and the tests' etcd)
  fleet             simulated fleets and routers as children; their addresses
  peers             sglang-router and vllm-router in a venv of their own
  workloads         seeded request streams with shared prefixes, and their fleet
  report            summaries, tables, JSON, plots (percentiles: router.metrics)
  bench_load        bench's client: the open loop, requests timed, hit-rate samples, scale events
  bench_targets     bench's targets: serve flags and labels, the shared etcd, logged decisions
  soak_load         soak's load: checked traffic, instance kills, the attackers' plan
  soak_observe      soak's view of the router: fds, RSS, stats samples, flatness windows

Dependencies: ``loadtests`` may import ``hashring`` and ``router``; this
package imports nothing at import time, so ``bench_membership`` children can
import ``router`` from another tree.
"""
