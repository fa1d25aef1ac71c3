"""One HTTP client for the tests' plain requests to live servers: httpx.get/post build an SSL context on every
call, tens of milliseconds, even for http:// URLs."""
import httpx

HTTP = httpx.Client(timeout=30)
