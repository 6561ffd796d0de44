"""A local stand-in for the few Hub HTTP endpoints that `hub_upload push` uses, for tests without network.

It answers like the Hub does for: creating a repository, creating a branch, validating README metadata, asking for
upload modes ("regular" for every file, so contents travel inside the commit) and the commit itself, and records every
request. Commits are decoded into `commits`: the repository, revision, message and the files with their bytes.
"""

import base64
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class RecordedCommit:
    repo_id: str
    revision: str
    summary: str
    files: dict[str, bytes]


@dataclass
class HubStandIn:
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, authorization)
    created_repos: list[dict] = field(default_factory=list)
    commits: list[RecordedCommit] = field(default_factory=list)
    url: str = ""

    def __enter__(self) -> "HubStandIn":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hub.requests.append(("POST", self.path, self.headers.get("Authorization")))
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts == ["api", "repos", "create"]:
                    payload = json.loads(body)
                    hub.created_repos.append(payload)
                    self.reply({"url": f"{hub.url}/{payload['organization']}/{payload['name']}"})
                elif parts[:2] == ["api", "validate-yaml"]:
                    self.reply({"errors": [], "warnings": []})
                elif parts[:2] == ["api", "models"] and parts[4] == "branch":
                    self.reply({})
                elif parts[:2] == ["api", "models"] and parts[4] == "preupload":
                    files = json.loads(body)["files"]
                    self.reply(
                        {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
                    )
                elif parts[:2] == ["api", "models"] and parts[4] == "commit":
                    hub.commits.append(decode_commit(f"{parts[2]}/{parts[3]}", parts[5], body))
                    oid = f"{len(hub.commits):040x}"
                    self.reply({"commitUrl": f"{hub.url}/{parts[2]}/{parts[3]}/commit/{oid}", "commitOid": oid})
                else:
                    self.send_error(404, f"the stand-in does not implement {self.path}")

            def reply(self, content: dict) -> None:
                data = json.dumps(content).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()


def decode_commit(repo_id: str, revision: str, body: bytes) -> RecordedCommit:
    """The Hub's commit payload is NDJSON: a header line, then one line per file (base64 content for regular files)."""
    lines = [json.loads(line) for line in body.splitlines() if line.strip()]
    header = next(line["value"] for line in lines if line["key"] == "header")
    files = {}
    for line in lines:
        if line["key"] == "file":
            assert line["value"]["encoding"] == "base64"
            files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
        elif line["key"] != "header":
            raise AssertionError(f"unexpected commit entry {line['key']!r}: the stand-in asked for regular uploads")
    return RecordedCommit(repo_id=repo_id, revision=revision, summary=header["summary"], files=files)
