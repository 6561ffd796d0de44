"""Command line: `python -m hub_upload export ...` and `python -m hub_upload push ...` (see --help)."""

import argparse
import math
import signal
import sys
import time

from .export import DEFAULT_MAX_SHARD_SIZE, export_checkpoint
from .model_card import ModelCardInfo
from .push import PushError, check_repo_id, format_size, plan_upload, push_folder
from .source import ExportInputError
from .verify import DEFAULT_VERIFY_TIMEOUT_S, ExportVerificationError
from .weights import parse_size


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hub_upload", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    export = commands.add_parser("export", help="write a self-contained trust_remote_code folder from an original one")
    export.add_argument(
        "--source",
        required=True,
        help="Kimi-VL folder: the original hub layout, or one written by save_pretrained (a fine-tune, or a model "
        "quantized by this project's KimiVLWeightOnlyConfig) with the processor saved beside it",
    )
    export.add_argument("--out", required=True, help="folder to create (refused if it exists, unless --overwrite)")
    export.add_argument(
        "--max-shard-size",
        type=_size,
        default=DEFAULT_MAX_SHARD_SIZE,
        help=f"largest weight shard, e.g. 5GB, 500MB, 2GiB (default {DEFAULT_MAX_SHARD_SIZE})",
    )
    export.add_argument(
        "--overwrite", action="store_true", help="replace an existing --out folder that is an earlier export or empty"
    )
    export.add_argument(
        "--delete-added-files",
        action="store_true",
        help="with --overwrite: also delete what was added to the earlier export (files no export writes); without "
        "it such an export is left alone and the added files are listed",
    )
    export.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip loading the export in a clean interpreter (for models too large for this machine)",
    )
    export.add_argument(
        "--verify-timeout",
        type=_seconds,
        default=DEFAULT_VERIFY_TIMEOUT_S,
        help=f"seconds the clean-interpreter check may take before the export is abandoned "
        f"(default {DEFAULT_VERIFY_TIMEOUT_S})",
    )
    export.add_argument("--license", default=ModelCardInfo.license, help="license in the model card (default: mit)")
    export.add_argument("--base-model", help="Hub id of the source checkpoint, for the model card")
    export.add_argument("--repo-id", help="Hub id the export will have, for the model card's snippets")

    push = commands.add_parser("push", help="upload an exported folder to the Hub in one commit")
    push.add_argument("--folder", required=True, help="a folder written by `export`")
    push.add_argument("--repo-id", required=True, help="ORG/NAME on the Hub (created if missing)")
    push.add_argument("--private", action="store_true", help="create the repository as private")
    push.add_argument("--revision", help="branch to commit to (created if missing; default: main)")
    push.add_argument("--dry-run", action="store_true", help="print what would be uploaded and stop")
    return parser


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = None
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(f"invalid time {text!r}: give a positive number of seconds, e.g. 600")
    return seconds


def run_export(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    result = export_checkpoint(
        args.source,
        args.out,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        delete_added_files=args.delete_added_files,
        verify=args.verify,
        verify_timeout=args.verify_timeout,
        card=ModelCardInfo(license=args.license, base_model=args.base_model, repo_id=args.repo_id),
    )
    verified = "verified in a clean interpreter" if result.verified else "NOT verified (--no-verify)"
    seconds = time.perf_counter() - started
    print(
        f"exported {len(result.files)} files ({result.num_shards} weight shards) to {result.folder}, {verified}, "
        f"in {seconds:.1f} s"
    )


def run_push(args: argparse.Namespace) -> None:
    check_repo_id(args.repo_id)
    plan = plan_upload(args.folder)
    target = f"{args.repo_id}@{args.revision or 'main'}" + (" (private)" if args.private else "")
    action = "would upload" if args.dry_run else "uploading"
    print(f"{action} {len(plan.files)} files, {format_size(plan.total_bytes)}, to {target} in one commit:")
    for name, size in plan.files:
        print(f"  {format_size(size):>10}  {name}")
    if plan.skipped:
        print(f"  not uploaded (hidden): {', '.join(plan.skipped)}")
    if args.dry_run:
        return
    commit = push_folder(plan, args.repo_id, private=args.private, revision=args.revision)
    print(f"committed {commit.oid}: {commit.commit_url}")


class Terminated(KeyboardInterrupt):
    """SIGTERM (from `kill`, systemd, a job scheduler), raised where the command is, like Ctrl+C's KeyboardInterrupt:
    the same clean-up runs (an export removes its temporary folder and stops its verification child)."""


def _raise_terminated(signum: int, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "export" and args.delete_added_files and not args.overwrite:
        parser.error("--delete-added-files only says what --overwrite may delete; pass --overwrite with it")
    previous_handler = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        (run_export if args.command == "export" else run_push)(args)
    except (ExportInputError, ExportVerificationError, PushError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the file system's own refusal (permissions, a full disk, a file where a folder goes)
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:
        stopped_by = signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT
        print(f"error: stopped by {stopped_by.name} before the {args.command} finished", file=sys.stderr)
        return 128 + stopped_by  # the shell's code for a process ended by that signal
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
