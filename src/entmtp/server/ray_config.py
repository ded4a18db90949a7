"""`entmtp serve --ray`'s settings, without Ray: the "Ray Serve" arguments, the application's arguments (what
`ray_serve.build_app` takes, JSON-safe, so a `serve deploy` YAML can carry them), the two deployments' Ray options,
and the YAML that `--print-config` prints. Ray itself is imported by ray_serve.py only, so every check here
runs (and is tested) without the `ray` extra.

Two deployments make the application (ray_serve.py says why):
    EntmtpFront   the HTTP ingress (FastAPI via serve.ingress): relays each request to an engine replica and
                  turns a replica's death into OpenAI's error shape; reserves no CPU
    EntmtpEngine  one engine per replica, `entmtp serve`'s app running in-process on its own torch thread;
                  reserves --threads CPUs (or a GPU) and takes up to --max-batch + --max-queue requests
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from ..build import EngineSpec
from ..errors import EntMTPError
from ..lookup import Lookup

APP_NAME = "entmtp"
IMPORT_PATH = "entmtp.server.ray_serve:build_app"  # what a `serve deploy` YAML names
INSTALL_HINT = "pip install 'entmtp[ray]'"
# after the engines' drain: time for the front to write a cut stream's error event and [DONE]
CUT_GRACE_S = 5.0
HEALTH_CHECK_S = 2.0  # Ray's health check period of an engine replica (Ray's default, 10 s, slows recovery)
# Ray Serve's own throughput settings (its RAY_SERVE_THROUGHPUT_OPTIMIZED set, less direct ingress and gRPC),
# given to a local cluster that `entmtp serve --ray` starts (its processes inherit them; one you set wins). By
# default every streamed message crosses threads twice more in each of the proxy, the front and the replica: the
# router's loop to the caller's, the user code's thread to the replica's loop. On a machine whose cores decode,
# those hops take their CPU. A cluster of your own (`ray start`) takes them from the environment of `ray start`.
# Two clocks wake Ray Serve's processes whether or not there is work: the controller's loop (Ray's default every
# 0.1 s) and each replica's and router's metrics export (every 0.1 s). A wake-up takes a core from a replica whose
# torch threads wait for each other at every op: on the 2-core EPYC at 8 clients, ray-1x2 gave 37.1, 41.7 and
# 41.3 tokens/s with Ray's clocks against 50.7, 43.2 and 48.5 with these (docs/results/ray-serve/README.md).
LOCAL_CLUSTER_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",  # user code on the replica's own event loop
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",  # a handle's router on its caller's event loop
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",  # the controller reconciles twice a second (Ray: 10 times)
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",  # replicas and routers export metrics once a second (Ray: 10)
}
SERVER_FIELDS = ("model_name", "max_batch", "max_queue", "max_body", "body_timeout", "acceptance")


@dataclass(frozen=True)
class RayServeConfig:
    """One Ray Serve application of entmtp: the engine every replica builds, the server settings of
    `entmtp serve`, and how many replicas (fixed, or autoscaled between bounds)."""

    spec: EngineSpec
    model_name: str = "smollm2-135m-instruct"  # the model id clients see
    max_batch: int = 8  # rows of each replica's continuous batch (`serve --max-batch`)
    max_queue: int = 8  # requests that may wait at a replica past its batch (`serve --max-queue`)
    max_body: int = 1 << 20  # largest request body in bytes
    body_timeout: float = 30.0  # seconds a body may take to arrive after its headers (then a 408)
    acceptance: str = "auto"  # the acceptance rule of requests at temperature > 0
    drain_timeout: float = 30.0  # on shutdown, seconds open requests may still run before they are cut
    replicas: int = 1  # engine replicas, when not autoscaled
    min_replicas: int | None = None  # autoscaling bounds: both None = a fixed `replicas`
    max_replicas: int | None = None
    target_ongoing: float | None = None  # autoscaling's ongoing requests per replica (None: max_batch)

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raise EntMTPError naming the first bad setting and its fix."""
        if self.max_batch < 1 or self.max_queue < 0 or self.max_body < 1:
            raise EntMTPError("--max-batch must be >= 1, --max-queue >= 0 and --max-body >= 1")
        if self.drain_timeout < 0 or self.body_timeout <= 0:
            raise EntMTPError("--drain-timeout must be >= 0 and --body-timeout > 0 (seconds)")
        if self.replicas < 1:
            raise EntMTPError(f"--replicas must be >= 1, got {self.replicas}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise EntMTPError("autoscaling needs both --min-replicas and --max-replicas")
        if self.autoscaled and not 1 <= self.min_replicas <= self.max_replicas:
            raise EntMTPError(
                f"--min-replicas {self.min_replicas} and --max-replicas {self.max_replicas}: need "
                "1 <= min <= max (at least one replica stays loaded: a model load takes seconds)"
            )
        if self.target_ongoing is not None and (not self.autoscaled or self.target_ongoing <= 0):
            raise EntMTPError("--target-ongoing needs --min-replicas/--max-replicas and must be > 0")

    @property
    def autoscaled(self) -> bool:
        return self.min_replicas is not None

    @property
    def threads(self) -> int:
        """CPUs each replica reserves and torch threads it runs (--threads; 1 when not given)."""
        return self.spec.threads or 1

    def to_dict(self) -> dict:
        """The application's arguments: JSON-safe, what `build_app` and a `serve deploy` YAML take."""
        d = dataclasses.asdict(self)
        d["spec"] = dataclasses.asdict(self.spec)  # its Lookup too: a dict or None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RayServeConfig:
        """The config `to_dict` wrote (a YAML's `args`); unknown keys are an EntMTPError naming them."""
        d = dict(d)
        spec = dict(d.pop("spec", {}))
        _check_keys(d, {f.name for f in dataclasses.fields(cls)} - {"spec"}, "args")
        _check_keys(spec, {f.name for f in dataclasses.fields(EngineSpec)}, "args.spec")
        lookup = spec.get("lookup")
        if isinstance(lookup, dict):
            _check_keys(lookup, {f.name for f in dataclasses.fields(Lookup)}, "args.spec.lookup")
            spec["lookup"] = Lookup(**lookup)
        return cls(spec=EngineSpec(**spec), **d)

    def engine_options(self) -> dict:
        """Ray's options of the engine deployment: its reserved CPUs (or GPU), how many requests it takes
        (its batch and its queue: the router sends no more), the replica count or autoscaling, the drain."""
        actor = {"num_cpus": self.threads}
        if self.spec.device.startswith("cuda"):
            actor = {"num_cpus": 1, "num_gpus": 1}
        opts = {
            "ray_actor_options": actor,
            "max_ongoing_requests": self.max_batch + self.max_queue,
            # past every replica's batch and queue, this many more wait at a router; more get a 503
            "max_queued_requests": max(self.max_queue, 1),
            "graceful_shutdown_timeout_s": self.drain_timeout,
            "graceful_shutdown_wait_loop_s": 0.5,
            "health_check_period_s": HEALTH_CHECK_S,
        }
        if self.autoscaled:
            target = self.target_ongoing if self.target_ongoing is not None else self.max_batch
            opts["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": target,
            }
        else:
            opts["num_replicas"] = self.replicas
        return opts

    def front_options(self) -> dict:
        """Ray's options of the front: no CPU reserved (it only relays), room for every request the engines
        may hold or queue, and a drain that outlasts theirs so a cut stream still gets its last event."""
        most = self.max_replicas if self.autoscaled else self.replicas
        return {
            "ray_actor_options": {"num_cpus": 0},
            "max_ongoing_requests": most * (self.max_batch + self.max_queue) + 2 * self.max_queue + 8,
            "graceful_shutdown_timeout_s": self.drain_timeout + CUT_GRACE_S,
        }

    def deploy_config(self, host: str, port: int) -> dict:
        """The `serve deploy` config (Ray's ServeDeploySchema) of this application on host:port."""
        app = {"name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH, "args": self.to_dict()}
        return {
            "proxy_location": "EveryNode",
            "http_options": {"host": host, "port": port},
            "applications": [app],
        }


def _check_keys(d: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise EntMTPError(
            f"unknown key(s) {', '.join(unknown)} in the application's {where}: "
            f"use {', '.join(sorted(known))} (write the config with `entmtp serve --ray --print-config`)"
        )


def config_from_args(args: argparse.Namespace, spec: EngineSpec) -> RayServeConfig:
    """The config of `entmtp serve --ray`'s arguments, the engine `spec` of its engine options."""
    return RayServeConfig(
        spec=spec,
        model_name=args.model_name or args.model or RayServeConfig.model_name,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_body=args.max_body,
        body_timeout=args.body_timeout,
        acceptance=args.request_acceptance,
        drain_timeout=args.drain_timeout,
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing=args.target_ongoing,
    )


def deploy_yaml(config: RayServeConfig, host: str, port: int, command: str) -> str:
    """`--print-config`'s text: the YAML of `deploy_config`, headed by how it was made and how to use it."""
    import yaml  # PyYAML: a dependency of transformers, always there

    head = (
        f"# made by: {command}\n"
        "# deploy on a running Ray cluster (every node with entmtp installed: "
        f"{INSTALL_HINT}):\n#   serve deploy THIS_FILE --address http://HEAD:8265\n"
    )
    return head + yaml.safe_dump(config.deploy_config(host, port), sort_keys=False)


def check_ray_arguments(args: argparse.Namespace) -> None:
    """The Ray Serve arguments given without --ray, and the server flags Ray Serve's replicas do not take
    given with it, are an EntMTPError naming them."""
    if args.ray:
        local = [f for f in ("batch_invariant", "api_docs") if getattr(args, f, False)]
        if local:
            flags = ", ".join("--" + name.replace("_", "-") for name in local)
            raise EntMTPError(f"{flags} apply to `entmtp serve` without --ray only: drop them or --ray")
        return
    given = [name for name, default in _RAY_DEFAULTS.items() if getattr(args, name) != default]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise EntMTPError(f"{flags} only apply to Ray Serve: add --ray")


_RAY_DEFAULTS = {
    "ray_address": None,
    "replicas": 1,
    "min_replicas": None,
    "max_replicas": None,
    "target_ongoing": None,
    "print_config": False,
}


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """The "Ray Serve" argument group of `entmtp serve`."""
    g = parser.add_argument_group(
        "Ray Serve",
        f"serve on a Ray cluster: replicas of the engine behind one endpoint (needs {INSTALL_HINT})",
    )
    g.add_argument(
        "--ray",
        action="store_true",
        help="serve with Ray Serve: --replicas engines (each with its own continuous batch, --threads CPUs), "
        "on a local Ray cluster started here, or on --ray-address's; --host/--port are Ray's HTTP proxy's",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (auto: the one `ray start` runs on this machine; ray://HEAD:10001 or "
        "HEAD:6379) instead of starting a local one",
    )
    g.add_argument("--replicas", type=int, default=1, help="engine replicas (default 1)")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest engine replicas")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscaling: most engine replicas")
    g.add_argument(
        "--target-ongoing",
        type=float,
        default=None,
        help="autoscaling: the ongoing requests per replica Ray scales to keep (default: --max-batch)",
    )
    g.add_argument(
        "--print-config",
        action="store_true",
        help="print the application as a YAML config for `serve deploy` and exit (nothing starts)",
    )
