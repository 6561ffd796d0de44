"""Export a Kimi-VL checkpoint as a self-contained trust_remote_code repository and publish it to the Hub.

python -m hub_upload export --source ORIGINAL_FOLDER --out EXPORT_FOLDER
python -m hub_upload push --folder EXPORT_FOLDER --repo-id ORG/NAME
"""

from .export import ExportResult, check_export_folder, export_checkpoint
from .model_card import ModelCardInfo
from .push import PushError, UploadPlan, plan_upload, push_folder
from .source import ExportInputError
from .verify import ExportVerificationError, run_isolated, verify_export

__all__ = [
    "ExportInputError",
    "ExportResult",
    "ExportVerificationError",
    "ModelCardInfo",
    "PushError",
    "UploadPlan",
    "check_export_folder",
    "export_checkpoint",
    "plan_upload",
    "push_folder",
    "run_isolated",
    "verify_export",
]
