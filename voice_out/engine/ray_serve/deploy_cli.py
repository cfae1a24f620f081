"""``voice-out ray-deploy``: deploy (or update) the engines as a Ray Serve application.

Run it anywhere that can reach the Ray cluster (``ray start --head`` on one host, ``ray start
--address HEAD:6379`` on the others, each with the model directory and the shared voices
directory at the same path). The application outlives the command; point fronts at it with
``voice-out serve --engine ray`` (``server.ray_address``, ``server.ray_app``).
"""

from __future__ import annotations

import argparse

from voice_out.config import Config
from voice_out.errors import VoiceOutError
from voice_out.hub import resolve_model


class RayUnavailableError(VoiceOutError):
    """The ``ray`` extra is not installed."""


def ray_deploy(cfg: Config, args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise RayUnavailableError("ray-deploy needs Ray Serve: pip install 'voice_out[ray]'") from None
    from voice_out.engine.ray_serve.replica import DeploymentOptions, deploy

    mc = cfg.model
    # fail here, in one line, rather than in every replica: the model must resolve (each host
    # of the cluster needs it at the same path or in its hub cache)
    resolve_model(mc.model, mc.cache_dir, revision=mc.revision, offline=mc.offline)
    options = DeploymentOptions(  # raises ConfigError, printed in one line by the CLI
        app_name=args.app or cfg.server.ray_app,
        num_replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_streams=args.target_streams,
        upscale_delay_s=args.upscale_delay_s,
        downscale_delay_s=args.downscale_delay_s,
        num_gpus=args.num_gpus,
        num_cpus=args.num_cpus,
    )
    deploy(cfg, options, address=args.address or cfg.server.ray_address)
    layout = (
        f"{options.num_replicas} replicas"
        if options.num_replicas is not None
        else f"{options.min_replicas}..{options.max_replicas} replicas at {options.target_streams:g} streams each"
    )
    print(f"voice_out: Serve application {options.app_name!r} is running ({layout}, {options.num_gpus:g} GPU each)")
    return 0
