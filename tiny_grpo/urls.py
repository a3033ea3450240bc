"""A URL's secrets: its USER:PASSWORD@ taken apart from the address (`credentials`), and the URL or a message that
quotes it as it may be printed, logged or stored (`redact`, `scrub`). Imported by the options, the reward service's
client and the logs, and importing nothing of the package."""

import re, urllib.parse  # noqa: E401

def credentials(url):
    """(url without its USER:PASSWORD@, 'user:password' percent-decoded or None). The userinfo ends at the last '@'
    before any '?', so a password may hold '/', ':' or '@' as typed, or percent-encoded (%40 for '@', %3F for '?')."""
    scheme, sep, rest = url.partition("://")
    head, query = re.match(r"([^?#]*)(.*)", rest, re.S).groups()
    userinfo, at, host = head.rpartition("@")
    if not sep or not at:
        return url, None
    return f"{scheme}://{host}{query}", urllib.parse.unquote(userinfo)

def redact(url):
    """url as it may be printed, logged or stored: USER:PASSWORD@ (up to the last '@') as ***@, the query as ?***."""
    if not url:
        return url
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    return scheme + sep + re.sub(r"[?#].*", "?***", rest, flags=re.S)

def scrub(text, url):
    """text (an exception's message) with url's secrets shown as redact shows them: the address urllib3 saw holds
    no password, but a query it may quote."""
    address, _ = credentials(url)
    query = re.match(r"[^?#]*\??([^#]*)", address).group(1)
    text = text.replace(url, redact(url)).replace(address, redact(url))
    return text.replace(query, "***") if query else text
