#!/bin/sh
# As the official image's entrypoint does: a redis-server started without a config file listens on
# every interface of the container, so protected mode (which refuses clients from other hosts when no
# password is set) is turned off; the container's network is the boundary.
set -e
if [ "${1#-}" != "$1" ]; then set -- redis-server "$@"; fi
if [ "$1" = redis-server ]; then
    case " $* " in *" --protected-mode "*) ;; *) set -- "$@" --protected-mode no ;; esac
fi
exec "$@"
