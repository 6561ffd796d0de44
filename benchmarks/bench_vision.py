"""Vision tower forward time for a fixed batch of mixed-size images.

Compares, in one run on the same weights:
  - packed: all images in one forward (one cu_seqlens, host metadata computed once), separable position resize
    with cached interpolation matrices;
  - one image at a time: one forward per image;
  - packed with the original's position resize: 2-D bicubic interpolation of the whole 64x64 table, per image,
    on every call.

MoonViT's real width (1152, 16 heads, 4304 MLP, 64x64 position table) is used; the depth defaults to 4 of the 27
blocks so that a 2-core CPU finishes in about a minute. The position resize is a fixed cost per image, so it is a
larger share of a shallow tower than of the full one; `--layers 27` measures the full depth.

    python -m benchmarks.bench_vision [--layers 4] [--repeats 5] [--device cpu|cuda]
"""

import argparse
import functools

import torch

from benchmarks.common import MIXED_GRIDS, mean_seconds, print_timings, write_result
from modeling_kimi_vl import MoonViTConfig, MoonViTModel
from tests.original_reference import original_resize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="number of MoonViT blocks (the release has 27)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    if args.layers < 1 or args.repeats < 1:
        parser.error("--layers and --repeats must be at least 1")
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    config = MoonViTConfig(num_hidden_layers=args.layers, attn_implementation="sdpa")
    tower = MoonViTModel(config).to(device=args.device, dtype=dtype).eval()
    pixel_values = torch.randn(sum(r * c for r, c in MIXED_GRIDS), 3, 14, 14, device=args.device, dtype=dtype)
    grid_hws = torch.tensor(MIXED_GRIDS)
    per_image = list(zip(pixel_values.split([r * c for r, c in MIXED_GRIDS]), grid_hws.split(1)))
    pos_emb = tower.patch_embed.pos_emb

    def packed():
        return tower(pixel_values, grid_hws).last_hidden_state

    def one_at_a_time():
        return torch.cat([tower(pv, grid).last_hidden_state for pv, grid in per_image])

    with torch.inference_mode():
        reference = packed()
        assert torch.allclose(one_at_a_time(), reference, rtol=1e-4, atol=1e-4), "per-image output differs"
        packed_seconds = mean_seconds(packed, args.repeats)
        one_at_a_time_seconds = mean_seconds(one_at_a_time, args.repeats)
        pos_emb._table_for = functools.partial(original_resize, pos_emb.weight)  # this instance only
        assert torch.allclose(packed(), reference, rtol=1e-4, atol=1e-4), "the original resize differs"
        original_resize_seconds = mean_seconds(packed, args.repeats)

    rows = [
        ("packed", packed_seconds),
        ("one image at a time", one_at_a_time_seconds),
        ("packed, original position resize", original_resize_seconds),
    ]
    print(f"MoonViT width 1152, {args.layers} blocks, {len(MIXED_GRIDS)} images, {pixel_values.shape[0]} patches, "
          f"{args.device} {args.dtype}")  # fmt: skip
    print_timings(rows, baseline="packed")

    path = write_result(
        f"bench_vision_{args.device}",
        {
            "config": {
                "layers": args.layers,
                "grids": MIXED_GRIDS,
                "patches": pixel_values.shape[0],
                "dtype": args.dtype,
            },
            "seconds": {name: seconds for name, seconds in rows},
            "speedup_packed_vs_one_at_a_time": one_at_a_time_seconds / packed_seconds,
            "speedup_position_resize_vs_original": original_resize_seconds / packed_seconds,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
