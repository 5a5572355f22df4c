"""`tokenloom pools up|status|scale|down`: the long-lived tokenizer services (platform/services.py).

State. `pools up` records what it started in `HOME/pools.json`: the Ray address, the HTTP URL, the
worker arguments each modality's service answers HTTP with (bundles and manifest), the replica
bounds, and whether it started Ray itself (then `pools down` stops it). `status`, `scale`, `down`
and `ingest --pools service` read it to find the cluster.

Ray. With `ingest.ray.address` set, the services go to that cluster; else to the Ray this
process already runs (tests), else to a local head `pools up` starts with `ray start --head` (one
resource label per pool, as a job's local Ray has), which outlives the command.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tokenloom.jobs.home import Home, open_catalog
from tokenloom.jobs.ingest import dataset_vocabulary
from tokenloom.tokenizers.vocab import manifest_from_bundles

STATE = "pools.json"
NEEDS = {"text": "text", "image": "visual", "audio": "audio"}  # the bundle kind each service adds to text


def _state_path(home: Home) -> Path:
    return home.root / STATE


def load_state(home: Home) -> dict:
    path = _state_path(home)
    if not path.exists():
        raise ValueError(f"no tokenizer services are up for {home.root} (no {STATE}): run `tokenloom pools up`")
    return json.loads(path.read_text())


def _connect(address: str) -> None:
    import ray

    from tokenloom.platform.ingest import token_auth_for_clusters

    if not ray.is_initialized():
        token_auth_for_clusters()
        ray.init(address=address, log_to_driver=False, configure_logging=False)


def _logical_cpus(cfg) -> int:
    """Logical CPUs of the local head: the cores, plus room for every service's replicas at their
    most and for a job's read and write tasks beside them (the OS shares the cores, as a job's own
    local Ray does): replicas that take all the CPUs would starve the jobs that call them."""
    service = cfg.ingest.service
    cores = cfg.ingest.ray.num_cpus or os.cpu_count() or 1
    replicas = sum(service.max_replicas.get(m, 0) or cores for m in ("text", "image", "audio")) * service.num_cpus
    return int(cores + replicas + 2)


def _start_ray(cfg) -> tuple[str, bool]:
    """The cluster the services go to: (address, whether this command started it)."""
    import ray

    if cfg.ingest.ray.address:
        return cfg.ingest.ray.address, False
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address, False
    labels: dict[str, float] = {}
    for pool in cfg.ingest.pools.values():
        if pool.resource_label:
            labels[pool.resource_label] = 1000  # a label marks where a pool runs; CPUs bound how much
    ray_bin = str(Path(sys.executable).parent / "ray")
    with socket.socket() as s:  # a free port for its GCS: 6379, Ray's default, is often another server's
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                           "--disable-usage-stats", "--include-dashboard=false",
                           f"--num-cpus={_logical_cpus(cfg)}",
                           f"--resources={json.dumps(labels)}"], capture_output=True, text=True,
                          env={**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")})
    if done.returncode:
        raise ValueError(f"could not start a local Ray head for the services: {done.stderr.strip()[-500:]}")
    ip = next((line.split("ray start --address=")[1].split("'")[1] for line in done.stdout.splitlines()
               if "ray start --address=" in line), f"127.0.0.1:{port}")
    return ip, True


def up(home: Home, cfg, dataset: str | None = None) -> dict:
    """Deploy a service per modality whose bundle exists (text always), answering HTTP with the
    latest bundles and `dataset`'s manifest (a new dataset's without one)."""
    import ray
    from ray import serve

    from tokenloom.platform.ingest import pool_worker_kwargs
    from tokenloom.platform.services import APP, application

    service = cfg.ingest.service
    service.validate()
    infos = {"text": home.bundle(None, "text")}
    for kind in ("visual", "audio"):
        with contextlib.suppress(ValueError, LookupError, FileNotFoundError):  # none of that kind: no service
            infos[kind] = home.bundle(None, kind)
    vocab = dataset_vocabulary(home, open_catalog(home, cfg), dataset, infos) if dataset else manifest_from_bundles(infos)
    vocab.save(home.vocab)
    paths = {k: str(i.path) for k, i in infos.items()}
    defaults = {m: pool_worker_kwargs(m, paths, vocab, cfg.ingest) for m, kind in NEEDS.items() if kind in infos}
    address, started = _start_ray(cfg)
    _connect(address)
    labels = {m: cfg.ingest.pool(m).resource_label for m in defaults}
    cpus = ray.cluster_resources().get("CPU", 1)
    serve.start(http_options={"host": service.host, "port": service.port})
    serve.run(application(defaults, labels, service, cpus), name=APP, route_prefix="/", blocking=False)
    state = {"address": address, "started_ray": started, "http": f"http://{service.host}:{service.port}",
             "dataset": dataset, "vocab_id": vocab.id, "defaults": defaults, "labels": labels, "cpus": cpus,
             "bounds": {}}
    _state_path(home).write_text(json.dumps(state, indent=2))
    return status(home, cfg)


def status(home: Home, cfg) -> dict:
    """Each service's deployment status, replicas by state and replica bounds."""
    from ray import serve

    from tokenloom.platform.services import APP, autoscaling

    state = load_state(home)
    _connect(state["address"])
    app = serve.status().applications.get(APP)
    if app is None:
        raise ValueError(f"the Ray cluster at {state['address']} runs no {APP!r} application: run `tokenloom pools up`")
    out = {"http": state["http"], "address": state["address"], "application": str(app.status), "services": {}}
    for name, dep in sorted(app.deployments.items()):
        doc = {"status": str(dep.status), "replicas": {str(k): v for k, v in dep.replica_states.items()}}
        if name in state["defaults"]:
            bounds = autoscaling(cfg.ingest.service, name, state["cpus"])
            lo, hi = state["bounds"].get(name, (bounds["min_replicas"], bounds["max_replicas"]))
            doc |= {"min_replicas": lo, "max_replicas": hi, "label": state["labels"].get(name)}
        out["services"][name] = doc
    return out


def scale(home: Home, cfg, modality: str, min_replicas: int, max_replicas: int) -> dict:
    """New replica bounds for one service (the others keep theirs); Serve updates it in place."""
    from ray import serve

    from tokenloom.platform.services import APP, application

    state = load_state(home)
    if modality not in state["defaults"]:
        raise ValueError(f"no {modality} service is up; services: {', '.join(sorted(state['defaults']))}")
    if not 0 <= min_replicas <= max_replicas or max_replicas < 1:
        raise ValueError(f"need 0 <= --min <= --max and --max >= 1, got {min_replicas} and {max_replicas}")
    state["bounds"][modality] = (min_replicas, max_replicas)
    _connect(state["address"])
    bounds = {m: tuple(b) for m, b in state["bounds"].items()}
    serve.run(application(state["defaults"], state["labels"], cfg.ingest.service, state["cpus"], bounds), name=APP,
              route_prefix="/", blocking=False)
    _state_path(home).write_text(json.dumps(state, indent=2))
    return status(home, cfg)


def down(home: Home, cfg) -> dict:
    """Delete the services (and stop the Ray head `pools up` started)."""
    from ray import serve

    state = load_state(home)
    _connect(state["address"])
    serve.shutdown()
    stopped = False
    if state["started_ray"]:
        import ray

        ray.shutdown()
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop"], capture_output=True)
        stopped = True
    _state_path(home).unlink()
    return {"down": True, "stopped_ray": stopped}
