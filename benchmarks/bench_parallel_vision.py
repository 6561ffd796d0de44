"""The vision tower on N processes: data mode (replicated tower, images shared out) vs weight mode (tensor-parallel
tower), for a mixed batch, with one process using all the same cores as the baseline.

    torchrun --nproc_per_node 2 -m benchmarks.bench_parallel_vision [--layers 4] [--repeats 5]

On a CPU machine torchrun gives every process one thread (OMP_NUM_THREADS=1); the baseline runs on rank 0 alone with
as many threads as there are processes, so all three variants use the same cores. MoonViT's real width (1152, 16
heads, 4304 MLP) is used with 4 of its 27 blocks by default. Rank 0 prints the table and writes
benchmarks/results/bench_parallel_vision_<device>_<N>proc.json.
"""

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import DistributedConfig

from benchmarks.common import MIXED_GRIDS, print_timings, seconds_of_one_call, write_result
from modeling_kimi_vl import MoonViTConfig, MoonViTModel
from modeling_kimi_vl.parallel_kimi_vl import assign_images_to_ranks, encode_images_data_parallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="number of MoonViT blocks (the release has 27)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("launch with torchrun, e.g. torchrun --nproc_per_node 2 -m benchmarks.bench_parallel_vision")
    if args.layers < 1 or args.repeats < 1:
        parser.error("--layers and --repeats must be at least 1")
    world_size = int(os.environ["WORLD_SIZE"])
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}") if torch.cuda.is_available() else torch.device("cpu")

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    # Rank 0 writes random weights into its temporary folder and every rank (one node) loads them from there.
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = [str(Path(folder) / "moonvit")]
        dist.broadcast_object_list(checkpoint, src=0)
        if rank == 0:
            torch.manual_seed(0)
            MoonViTModel(MoonViTConfig(num_hidden_layers=args.layers)).save_pretrained(checkpoint[0])
        dist.barrier()
        weight_tower = MoonViTModel.from_pretrained(
            checkpoint[0], distributed_config=DistributedConfig(tp_size=world_size), attn_implementation="sdpa"
        ).eval()
        replicated_tower = MoonViTModel.from_pretrained(checkpoint[0], attn_implementation="sdpa").to(device).eval()
        dist.barrier()  # rank 0 removes the folder when it leaves this block

    generator = torch.Generator().manual_seed(1)
    pixel_values = torch.randn(sum(r * c for r, c in MIXED_GRIDS), 3, 14, 14, generator=generator).to(device)
    grid_hws = torch.tensor(MIXED_GRIDS)

    def data_mode():
        return encode_images_data_parallel(replicated_tower, pixel_values, MIXED_GRIDS)

    def weight_mode():
        return weight_tower(pixel_values, grid_hws).last_hidden_state

    def one_process():
        return replicated_tower(pixel_values, grid_hws).last_hidden_state

    threads_per_process = torch.get_num_threads()
    baseline_threads = threads_per_process * world_size if device.type == "cpu" else threads_per_process

    def one_process_on_rank_0():
        # Rank 0 alone, with the threads of all the processes, while the others wait.
        if rank == 0:
            torch.set_num_threads(baseline_threads)
            one_process()
            torch.set_num_threads(threads_per_process)

    with torch.inference_mode():
        reference = one_process()
        torch.testing.assert_close(data_mode(), reference, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(weight_mode(), reference, rtol=1e-4, atol=1e-4)
        # The variants take turns within every repeat, so that a change in the machine's load hits them alike.
        variants = {"1 process": one_process_on_rank_0, "data mode": data_mode, "weight mode": weight_mode}
        timings = {name: [] for name in variants}
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, function in variants.items():
                dist.barrier()
                timings[name].append(seconds_of_one_call(function))
        dist.barrier()
        single_seconds, data_seconds, weight_seconds = (statistics.median(timings[name][1:]) for name in variants)

    if rank == 0:
        loads = [r * c for r, c in MIXED_GRIDS]
        patches_per_rank = [sum(loads[i] for i in images) for images in assign_images_to_ranks(loads, world_size)]
        rows = [
            (f"1 process, {baseline_threads} thread(s)", single_seconds),
            (f"data mode, {world_size} processes", data_seconds),
            (f"weight mode, {world_size} processes", weight_seconds),
        ]
        print(f"MoonViT width 1152, {args.layers} blocks, {len(MIXED_GRIDS)} images, {pixel_values.shape[0]} patches "
              f"(per rank in data mode: {patches_per_rank}), {device.type}")  # fmt: skip
        print_timings(rows, baseline=rows[0][0])
        path = write_result(
            f"bench_parallel_vision_{device.type}_{world_size}proc",
            {
                "config": {
                    "layers": args.layers,
                    "grids": MIXED_GRIDS,
                    "patches": pixel_values.shape[0],
                    "processes": world_size,
                    "threads_per_process": threads_per_process,
                    "data_mode_patches_per_rank": patches_per_rank,
                },
                "seconds": {name: seconds for name, seconds in rows},
                "every_repeat_seconds": {name: values[1:] for name, values in timings.items()},
                "speedup_data_vs_weight": weight_seconds / data_seconds,
                # Within one repeat both modes met the same machine load: the median of those ratios is the steadier.
                "speedup_data_vs_weight_paired_median": statistics.median(
                    weight / data for weight, data in zip(timings["weight mode"][1:], timings["data mode"][1:])
                ),
                "speedup_data_vs_1_process": single_seconds / data_seconds,
                "speedup_weight_vs_1_process": single_seconds / weight_seconds,
            },
        )
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
