"""Waiting, bounded, for something the service does in the background."""
import time


def wait_until(predicate, timeout, interval=0.05):
    """True once predicate() is, polled every `interval` s for at most
    `timeout` s (monotonic clock); after that, predicate()'s last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
