"""`tgi-hpc serve`: render the serve job, submit it, optionally wait until it really answers."""
from __future__ import annotations

import click

from tgi_hpc.cli._app import App, with_app
from tgi_hpc.errors import UsageError
from tgi_hpc.models.quantization import AT_LOAD, SUPPORTED

LIMITS = ("max_input_tokens", "max_total_tokens", "max_batch_prefill_tokens", "max_batch_total_tokens",
          "max_concurrent_requests", "max_best_of", "max_stop_sequences")


def _limit_options(func):
    for name in reversed(LIMITS):
        func = click.option(f"--{name.replace('_', '-')}", name, type=click.IntRange(min=1),
                            help="Engine limit (TGI's name and meaning).")(func)
    return func


@click.command()
@click.option("--model", "-m", "models", required=True, multiple=True,
              help="Hub id in the model store (ORG/NAME) or a local snapshot directory. Repeat it to serve several "
                   "models in one job: one engine each, on its own port and GPUs (or GPU memory share).")
@click.option("--lora", "loras", multiple=True, metavar="NAME=ORG/ADAPTER",
              help="Serve a PEFT LoRA adapter (from the model store, or NAME=FOLDER) beside its base model; "
                   "requests choose it by NAME (adapter_id, or OpenAI's model). Repeatable.")
@click.option("--speculative-model", metavar="ORG/NAME|FOLDER",
              help="Draft tokens with this (from the model store, or a folder): a smaller model with the same "
                   "tokenizer, Medusa heads or an EAGLE-3 draft; staged beside the weights. Needs "
                   "--engine-arg --speculate=N (or auto).")
@click.option("--cuda-memory-fraction", "memory_fractions", multiple=True, type=float, metavar="F",
              help="Share of each GPU's memory for the engine, once per --model (default with several models "
                   "on fewer GPUs than models: from the models' sizes).")
@click.option("--revision", default="main", show_default=True, help="Revision of a stored Hub model.")
@click.option("--gpus", "--num-shard", "gpus", type=click.IntRange(min=0),
              help="GPUs of the job, all nodes together (= tensor-parallel shards on one node). Default: from the model size.")
@click.option("--gpu-type", help="GPU type, one of the cluster's (`tgi-hpc profiles show`: slurm.gpu_types), e.g. l40s, "
                                 "h100 or a MIG slice. Default: the profile's. Sizes the job from that type's memory.")
@click.option("--nodes", type=click.IntRange(min=1),
              help="Nodes for one server (--gpus split evenly over them; tensor parallelism within a node, pipeline "
                   "stages across nodes). Default: 1, or as many as a model too large for one node needs.")
@click.option("--time", "time_", help="Slurm time limit, e.g. 3:00:00.")
@click.option("--partition", "-p", help="Slurm partition. Default: the profile's serve partition.")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]), help="Weights and compute dtype.")
@click.option("--quantize", type=click.Choice(["none", *SUPPORTED], case_sensitive=False),
              help=f"Quantize a float checkpoint at load ({', '.join(AT_LOAD)}); GPTQ, AWQ and "
                   "compressed-tensors checkpoints are read from their config without it. Sizes the job.")
@_limit_options
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE", help="Extra environment variable for the job.")
@click.option("--engine-arg", "engine_args", multiple=True, metavar="FLAG=VALUE", help="Other engine flag, checked against the known ones.")
@click.option("--release", help="Engine release directory. Default: the profile's current release.")
@click.option("--no-shared-weights", is_flag=True,
              help="Use the model store even when the profile's read-only weight folders (Mila: /network/weights) have the model.")
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="Jobs serving the model at once, as one service (see --service).")
@click.option("--service", "service_name", help="Name of the service (default: from the model); "
                                                "`tgi-hpc endpoint/tunnel/stop NAME` find its replicas.")
@click.option("--handover", "handover_lead", metavar="LEAD",
              help="Submit each job's successor so that it is READY LEAD (seconds or 15:00) before the time limit.")
@click.option("--keep-alive", is_flag=True, help="A service that outlives its jobs: --handover with the lead "
                                                 "learned from the queue wait and load time.")
@click.option("--requeue", is_flag=True, help="One job that requeues itself before its time limit and on "
                                              "preemption (same job id and port; down while it queues again).")
@click.option("--no-api-key", is_flag=True, help="Serve without an API key (anyone on the cluster network can use it).")
@click.option("--wait/--no-wait", "wait_ready", default=False, help="Wait until the server is READY.")
@click.option("--timeout", default=1800.0, show_default=True, help="Seconds to wait with --wait.")
@click.option("--tunnel", "open_tunnel", is_flag=True,
              help="From a laptop: wait for READY, then forward 127.0.0.1:PORT here to the server until Ctrl-C.")
@click.option("--local-port", type=click.IntRange(0, 65535), help="With --tunnel: port here (default: the job's).")
@click.option("--stop-on-exit", is_flag=True, help="With --tunnel: stop the job when the tunnel closes.")
@click.option("--dry-run", is_flag=True, help="Print the job script; submit nothing.")
@with_app
def serve(app: App, models, loras, speculative_model, memory_fractions, revision, gpus, gpu_type, nodes, time_, partition, dtype, quantize, env,
          engine_args, release, keep_alive, no_api_key, wait_ready, timeout, open_tunnel, local_port, stop_on_exit, dry_run,
          no_shared_weights, replicas, service_name, handover_lead, requeue, **limits) -> None:
    """Submit a server job for MODEL (or several: one engine each) and print its job id and endpoint."""
    from tgi_hpc.workflows.serve import ServeOptions, gpu_type_from_overrides, run_serve

    limits.update(dtype=dtype, quantize=quantize)
    opts = ServeOptions(model=models[0], other_models=list(models[1:]), loras=list(loras),
                        memory_fractions=list(memory_fractions), revision=revision, gpus=gpus, nodes=nodes, time=time_,
                        gpu_type=gpu_type if gpu_type is not None else gpu_type_from_overrides(app.overrides),
                        partition=partition, limits=limits,
                        env=list(env), engine_args=list(engine_args), keep_alive=requeue, api_key=not no_api_key,
                        shared_weights=not no_shared_weights, speculative_model=speculative_model)
    cluster = app.cluster(strict_paths=not dry_run)
    if replicas > 1 or service_name or handover_lead or keep_alive:
        if len(models) > 1:
            raise UsageError("a service (--replicas/--handover/--keep-alive) serves one --model; "
                             "run one service per model")
        from tgi_hpc.cli.service import serve_service
        from tgi_hpc.workflows.service import ServiceOptions

        if requeue:
            raise UsageError("--requeue is for a single job; a service (--replicas/--handover/--keep-alive) "
                             "hands over to a successor instead")
        svc = ServiceOptions(service_name, replicas, bool(handover_lead or keep_alive), handover_lead)
        serve_service(app, cluster, opts, svc, release=release, dry_run=dry_run, wait=wait_ready, timeout=timeout,
                      open_tunnel=open_tunnel, local_port=local_port, stop_on_exit=stop_on_exit)
        return
    # with --tunnel, the wait for READY happens inside the try below (so --stop-on-exit covers it)
    result = run_serve(cluster, opts, release=release, dry_run=dry_run, wait=wait_ready and not open_tunnel,
                       timeout=timeout, progress=app.info, again=app.again())
    from tgi_hpc.cli.tunnel import deliver
    from tgi_hpc.slurm import jobs
    from tgi_hpc.workflows.tunnel_session import open_tunnel as start_tunnel

    deliver(app, cluster, result, dry_run=dry_run, open_tunnel=open_tunnel, stop_on_exit=stop_on_exit,
            tunnel=lambda: start_tunnel(cluster, result.job_id, local_port=local_port, timeout=timeout,
                                        accept_host_key=app.accept_host_key,
                                        progress=app.info),
            stop=lambda: jobs.stop(cluster, [result.job_id]))

