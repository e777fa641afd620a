"""A TCP connection whose window is exactly N bytes: the receiver's clamp, held.

How it fits: the goodput probe (``goodput.py``) and the training transport
(``testbed/train/transport.py``, for ``parallel.tcp_window_bytes``) both need a window of a
given size on any path.  Socket buffers alone do not give one: the window the kernel makes
of a buffer is the buffer times the payload/truesize ratio of the packets received, which
differs by path (buffers of N gave a window of 1.0-1.33 N across one machine's veths and
about 0.66 N across a VXLAN).  A route's ``window`` metric clamps only until the connection
is set up.  So ``set_window`` sets ``TCP_WINDOW_CLAMP`` with buffers locked behind it large
enough never to bind (locking also turns receive autotuning off, which would raise the
clamp), and the reader calls ``hold_window`` after its reads: when the payload/truesize
ratio of arriving packets changes, this kernel (6.18) resets the clamp to what the buffer
allows (``tcp_measure_rcv_mss``), user clamp or not (at the first data in 2 of 10 probe
flows here: clamp 100,000 -> 265,625 bytes, the flow 1.31x faster than clamped).
"""

from __future__ import annotations

import socket

_TCP_WINDOW_CLAMP = getattr(socket, "TCP_WINDOW_CLAMP", 10)
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


def set_window(sock: socket.socket, window: int, buffer_bytes: int | None = None, send_buffer: bool = False) -> None:
    """Clamp ``sock``'s window at ``window`` bytes, its receive buffer (and with ``send_buffer``
    its send buffer) locked at ``buffer_bytes`` (twice the window by default); past
    net.core.rmem_max/wmem_max where root.  On a listening socket the connections inherit it."""
    nbytes = buffer_bytes or 2 * window
    pairs = [(_SO_RCVBUFFORCE, socket.SO_RCVBUF)]
    if send_buffer:
        pairs.insert(0, (_SO_SNDBUFFORCE, socket.SO_SNDBUF))
    for force, plain in pairs:
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, nbytes)
        except PermissionError:
            sock.setsockopt(socket.SOL_SOCKET, plain, nbytes)
    sock.setsockopt(socket.IPPROTO_TCP, _TCP_WINDOW_CLAMP, window)


def hold_window(sock: socket.socket, window: int) -> bool:
    """Set the clamp again where the kernel moved it (see the module docstring); True if it had."""
    if sock.getsockopt(socket.IPPROTO_TCP, _TCP_WINDOW_CLAMP) == window:
        return False
    sock.setsockopt(socket.IPPROTO_TCP, _TCP_WINDOW_CLAMP, window)
    return True
