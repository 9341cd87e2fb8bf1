"""fetch_url: GET a URL and return status, content type and (capped) body text.

The runtime has already checked that the URL's scheme and host fall under the manifest's
``network:*`` hints. No redirect is followed: a redirect could lead to a host the manifest
never named, so it is returned as is (status and ``location``) for the caller to decide.
"""

import json
import sys
import urllib.error
import urllib.request


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None


def main() -> int:
    args = json.load(sys.stdin)
    url, max_bytes = args["url"], int(args.get("max_bytes", 65536))
    opener = urllib.request.build_opener(NoRedirect)
    try:
        response = opener.open(url, timeout=10)
    except urllib.error.HTTPError as exc:
        response = exc  # 4xx/5xx and unfollowed redirects still have a status and a body
    except (urllib.error.URLError, OSError) as exc:
        json.dump({"error": f"cannot fetch {url}: {getattr(exc, 'reason', exc)}"}, sys.stdout)
        sys.stdout.write("\n")
        return 1
    with response:
        data = response.read(max_bytes + 1)
        result = {
            "url": url,
            "status": response.status,
            "content_type": response.headers.get("Content-Type"),
            "location": response.headers.get("Location"),
            "body": data[:max_bytes].decode("utf-8", errors="replace"),
            "truncated": len(data) > max_bytes,
        }
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
