"""Files a run writes in one piece: through a new file made in the same folder, renamed into place when complete.
Standard library only (tiny_grpo.view draws the page with it)."""

import os, tempfile  # noqa: E401
from pathlib import Path


def write_atomically(path, content):
    """Replace the file at path with content (str, written as UTF-8; bytes; or an iterable of bytes pieces, written
    one by one) in one rename: a crash leaves the old file or the new one. It is written through a new file that
    mkstemp creates in path's folder (O_CREAT | O_EXCL: never through a left-over name, nor a symbolic link that would
    lead the write out of the folder), and renamed over path (over a link there as well, never through it). Readable
    by all, as the files a run writes."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp's is 0o600
            if isinstance(content, str):
                f.write(content.encode("utf-8"))
            elif isinstance(content, (bytes, bytearray)):
                f.write(content)
            else:
                f.writelines(content)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
