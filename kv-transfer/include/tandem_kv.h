/*
 * tandem_kv.h — the stable C ABI between tandem and a third-party KV-transfer backend.
 *
 * ABI version 1. A backend is a shared library exporting one symbol:
 *
 *     const tandem_kv_plugin *tandem_kv_plugin_v1(void);
 *
 * tandem loads it by path at run time (`--kv-connector plugin:/path/libfoo.so[?config]`) and never links
 * against it. The library only has to move *messages* between two instances of itself: a message is a short
 * header (opaque bytes, at most TANDEM_KV_MAX_HEADER bytes) plus an optional payload gathered from, and
 * scattered into, memory tandem names. tandem does everything else on top: the handshake (model, dtype,
 * geometry, protocol version), per-chunk checksums, ordering checks, timeouts and cancellation. A backend
 * cannot make tandem mark corrupted KV as ready: tandem verifies every chunk after the backend says it landed.
 *
 * Compatibility rules
 *  - `abi_version` is checked first; tandem refuses a plugin whose major version it does not know.
 *  - `struct_size` lets later minor versions append fields to the vtable: tandem reads only the fields that
 *    fit in `struct_size`, a plugin reads only the host fields that fit in `tandem_kv_host.struct_size`.
 *  - Existing fields never move or change meaning within a major version.
 *
 * Threading rules
 *  - Every plugin function except `destroy` may be called from any thread, concurrently, including `send`
 *    on one link. `destroy` is called once, when no other call into the instance is running.
 *  - `send` may block (that is the backpressure): tandem calls it from threads that may block.
 *  - The plugin calls host callbacks from its own threads. Host callbacks are thread-safe, never block for
 *    long and never call back into the plugin synchronously (tandem calls `send`/`close_link` from its own
 *    threads). A plugin must not call host callbacks after `destroy` returned; deliveries still in flight
 *    when `destroy` begins are abandoned without `on_payload` (tandem reclaims that memory itself).
 *  - tandem ignores SIGPIPE; a plugin meant for other hosts too should avoid raising it (MSG_NOSIGNAL).
 *
 * Ordering and delivery
 *  - A link is a reliable, ordered, bidirectional message stream between two instances. Messages are
 *    delivered whole (header then payload), never interleaved with other messages of the same link, and
 *    in the order their `send` calls returned.
 *  - When a link fails (peer gone, I/O error), the plugin calls `on_link_closed` once for it, on both sides
 *    where it can, and fails pending and later `send` calls on it.
 */
#ifndef TANDEM_KV_H
#define TANDEM_KV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TANDEM_KV_ABI_VERSION 1u

/* Largest message header tandem sends. A plugin may rely on it to size buffers. */
#define TANDEM_KV_MAX_HEADER 4096u
/* Largest number of iovecs a payload is gathered from or scattered into. */
#define TANDEM_KV_MAX_IOVS 256u

/* Status codes returned by plugin functions and passed to callbacks. 0 is success. */
#define TANDEM_KV_OK 0
#define TANDEM_KV_ERR_INVALID -1     /* bad argument (unknown link, NULL, too many iovecs, ...) */
#define TANDEM_KV_ERR_UNREACHABLE -2 /* endpoint refused, unknown or not answering */
#define TANDEM_KV_ERR_IO -3          /* link failed while sending or receiving */
#define TANDEM_KV_ERR_CLOSED -4      /* link or instance already closed */
#define TANDEM_KV_ERR_UNSUPPORTED -5 /* e.g. device memory given to a host-only plugin */
#define TANDEM_KV_ERR_INTERNAL -6    /* anything else; see last_error */

/* Capability flags (tandem_kv_plugin.capabilities). */
#define TANDEM_KV_CAP_HOST_MEMORY (1ull << 0)   /* payloads in ordinary host memory */
#define TANDEM_KV_CAP_DEVICE_MEMORY (1ull << 1) /* payloads in CUDA device memory */
#define TANDEM_KV_CAP_CROSS_HOST (1ull << 2)    /* endpoints reachable from other hosts */
#define TANDEM_KV_CAP_CROSS_PROCESS (1ull << 3) /* endpoints reachable from other processes */

/* Memory kinds of an iovec. */
#define TANDEM_KV_MEM_HOST 0u
#define TANDEM_KV_MEM_CUDA 1u

/* One contiguous piece of a payload. For TANDEM_KV_MEM_CUDA, `addr` is a device pointer of `device`. */
typedef struct tandem_kv_iov {
    void *addr;
    uint64_t len;
    uint32_t mem_kind;
    int32_t device;
} tandem_kv_iov;

/* Opaque plugin instance. */
typedef struct tandem_kv_instance tandem_kv_instance;

/* Link ids are chosen by the plugin, unique within one instance for its lifetime, never 0. */
typedef uint64_t tandem_kv_link;

/* What on_message tells the plugin to do with the payload. */
#define TANDEM_KV_DELIVER 0 /* write the payload into the iovecs filled in, then call on_payload */
#define TANDEM_KV_DISCARD 1 /* read and drop the payload; do not call on_payload */

/* Callbacks tandem gives to an instance at creation. */
typedef struct tandem_kv_host {
    uint32_t abi_version; /* TANDEM_KV_ABI_VERSION of the host */
    uint32_t struct_size; /* sizeof(tandem_kv_host) as the host was built */
    void *ctx;            /* pass back as the first argument of every callback */

    /*
     * A message arrived on `link` (an incoming link the first time its id is seen). `header` is valid only
     * during the call. If `payload_len` > 0, the host fills up to `max_iovs` iovecs with where the payload
     * goes (their lengths sum to payload_len), stores their number in `*n_iovs` and a token in `*token`, and
     * returns TANDEM_KV_DELIVER; or returns TANDEM_KV_DISCARD. With payload_len == 0 the return is DISCARD
     * and nothing else happens.
     */
    int (*on_message)(void *ctx, tandem_kv_link link, const uint8_t *header, size_t header_len,
                      uint64_t payload_len, tandem_kv_iov *iovs, size_t max_iovs, size_t *n_iovs,
                      uint64_t *token);

    /*
     * The payload announced with `token` has been written completely (status 0) or not (status < 0).
     * Every TANDEM_KV_DELIVER is answered by exactly one on_payload, also when the link fails or is closed
     * meanwhile (then with status < 0, before on_link_closed). tandem keeps the destination memory reserved
     * until then, so the plugin must not touch the iovecs after calling it.
     */
    void (*on_payload)(void *ctx, tandem_kv_link link, uint64_t token, int status);

    /*
     * The link is gone; `reason` (may be NULL) is valid only during the call. Called at most once per link;
     * tandem ignores it for link ids it has not seen yet.
     */
    void (*on_link_closed)(void *ctx, tandem_kv_link link, int status, const char *reason);
} tandem_kv_host;

/* The vtable a plugin exports. */
typedef struct tandem_kv_plugin {
    uint32_t abi_version; /* TANDEM_KV_ABI_VERSION the plugin was built against */
    uint32_t struct_size; /* sizeof(tandem_kv_plugin) as the plugin was built */
    uint64_t capabilities;
    const char *name; /* short, static, e.g. "uds" */

    /*
     * Creates an instance that listens for incoming links. `config` is the text after '?' in the connector
     * spec (may be empty, never NULL). `host` stays valid until destroy returns.
     */
    int (*create)(const char *config, const tandem_kv_host *host, tandem_kv_instance **out);

    /* Closes every link, stops every thread, frees the instance. No callbacks after it returns. */
    void (*destroy)(tandem_kv_instance *inst);

    /* The endpoint other instances pass to connect. Static for the instance's lifetime. */
    const char *(*endpoint)(tandem_kv_instance *inst);

    /* Opens a new link to `endpoint`. Fails fast (TANDEM_KV_ERR_UNREACHABLE) when nobody listens. */
    int (*connect)(tandem_kv_instance *inst, const char *endpoint, tandem_kv_link *out);

    /*
     * Sends one message. The header bytes and the payload memory may be reused once send returns, so a
     * plugin that sends asynchronously must wait for the data to leave the iovecs before returning.
     * A payload of n_iovs == 0 is empty.
     */
    int (*send)(tandem_kv_instance *inst, tandem_kv_link link, const uint8_t *header, size_t header_len,
                const tandem_kv_iov *iovs, size_t n_iovs);

    /*
     * Closes a link (either side). Idempotent; unknown ids are ignored. on_link_closed is not called for a
     * link the host closed, but a delivery already under way still ends with its on_payload (status < 0).
     */
    void (*close_link)(tandem_kv_instance *inst, tandem_kv_link link);

    /* A description of the last error on the calling thread; static or thread-local storage, never NULL. */
    const char *(*last_error)(void);
} tandem_kv_plugin;

/* The one exported symbol. */
typedef const tandem_kv_plugin *(*tandem_kv_plugin_entry_fn)(void);
#define TANDEM_KV_PLUGIN_ENTRY "tandem_kv_plugin_v1"

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_KV_H */
