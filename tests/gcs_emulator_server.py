"""gcp-storage-emulator with GCS's generation preconditions: ``python tests/gcs_emulator_server.py start …``.

The emulator (2026.7) ignores ``ifGenerationMatch``, which real GCS honours on uploads, copies, downloads and
deletes and which docbeam's output lock and fenced commit depend on (412 Precondition Failed when the object's
generation differs; 0 means "must not exist"). This wraps those handlers to check it first. The emulator
serves one request at a time (http.server.HTTPServer), so the check and the change cannot interleave.
"""

from __future__ import annotations

import sys
from http import HTTPStatus

from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects


def _generation(storage, bucket: str, name: str | None) -> str:
    try:
        return str(storage.get_file_obj(bucket, name)["generation"]) if name else "0"
    except NotFound:
        return "0"


def _target(request) -> tuple[str, str | None]:
    params = request.params
    if "dest_object_id" in params:
        return params["dest_bucket_name"], params["dest_object_id"]
    if "object_id" in params:
        return params["bucket_name"], params["object_id"]
    if "name" in request.query:
        return params["bucket_name"], request.query["name"][0]
    data = request.data if request.query.get("uploadType") == ["multipart"] else None
    return params["bucket_name"], (data or {}).get("meta", {}).get("name")


def with_precondition(handler):
    def checked(request, response, storage, *args, **kwargs):
        wanted = request.query.get("ifGenerationMatch")
        if wanted is not None:
            bucket, name = _target(request)
            if _generation(storage, bucket, name) != wanted[0]:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json(
                    {
                        "error": {
                            "code": 412,
                            "message": "conditionNotMet",
                            "errors": [{"reason": "conditionNotMet", "message": "Precondition Failed"}],
                        }
                    }
                )
                return None
        return handler(request, response, storage, *args, **kwargs)

    return checked


CHECKED = {
    objects.insert,
    objects.upload_partial,
    objects.copy,
    objects.rewrite,
    objects.get,
    objects.download,
    objects.delete,
}
for _, handlers in server.HANDLERS:
    for method, handler in list(handlers.items()):
        if handler in CHECKED:
            handlers[method] = with_precondition(handler)

if __name__ == "__main__":
    main(sys.argv[1:])
