/* gpufeed's staging copy: host memory to pinned buffers on a team of threads that take small pieces.
 *
 * torch's CPU copy splits a copy into one static share per OpenMP thread, so the whole copy waits for
 * the slowest thread, and any thread that shares its core (the training thread, the CUDA driver's,
 * a worker) makes one. Here each thread takes the next 256 KiB piece until none is left: a slowed thread
 * just copies fewer pieces. Built on first use by gpufeed._hostcopy with the system C compiler (as
 * Triton builds its launchers) and called through ctypes, which releases the GIL for the call.
 *
 * Calls are serialized (one team per process). The team is created on first use and again in a forked
 * child (whose copy of this state names threads that do not exist there); fork waits for a copy in
 * progress to end, so a child never starts with the call lock taken.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>

#define MAX_THREADS 256

struct job {
    char *const *dst;
    char *const *src;
    const size_t *len;
    const size_t *first; /* first[k]: index of segment k's first piece; first[count]: all pieces */
    int count;
    size_t piece;
    atomic_size_t next;
};

static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER; /* one copy at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t done = PTHREAD_COND_INITIALIZER;
static struct job *current;
static unsigned long generation;
static int running;   /* team threads still working on the current job */
static int team_size; /* threads started in this process, besides the caller */
static int team_want; /* how many of them take part in the current job */
static pid_t owner;   /* the process that started them */
static unsigned long start_generation[MAX_THREADS];

static void run(struct job *j) {
    size_t total = j->first[j->count];
    int k = 0;
    for (;;) {
        size_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= total) return;
        int lo = k, hi = j->count - 1; /* the segment holding piece i: pieces are taken in order */
        if (i < j->first[lo]) lo = 0;
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (j->first[mid] <= i) lo = mid; else hi = mid - 1;
        }
        k = lo;
        size_t off = (i - j->first[k]) * j->piece;
        size_t n = j->len[k] - off < j->piece ? j->len[k] - off : j->piece;
        memcpy(j->dst[k] + off, j->src[k] + off, n);
    }
}

static void *team_main(void *arg) {
    long index = (long)arg;
    pthread_mutex_lock(&mu);
    unsigned long seen = start_generation[index]; /* a job posted since its creation is still its own */
    for (;;) {
        while (generation == seen) pthread_cond_wait(&wake, &mu);
        seen = generation;
        struct job *j = current;
        int take_part = index < team_want;
        pthread_mutex_unlock(&mu);
        if (take_part) run(j);
        pthread_mutex_lock(&mu);
        if (--running == 0) pthread_cond_signal(&done);
    }
    return NULL;
}

/* Start team threads up to `threads - 1`; 0 on success. Called with call_mu held. */
static int grow(int threads) {
    if (owner != getpid()) { /* first use, or a forked child: no team threads exist here */
        pthread_mutex_init(&mu, NULL);
        pthread_cond_init(&wake, NULL);
        pthread_cond_init(&done, NULL);
        team_size = 0;
        generation = 0;
        owner = getpid();
    }
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    while (team_size < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 << 10);
        pthread_mutex_lock(&mu);
        start_generation[team_size] = generation;
        int rc = pthread_create(&t, &attr, team_main, (void *)(long)team_size);
        if (rc == 0) team_size++;
        pthread_mutex_unlock(&mu);
        pthread_attr_destroy(&attr);
        if (rc != 0) return rc;
    }
    return 0;
}

/* Copy segment k: len[k] bytes from src[k] to dst[k], for k < count, on `threads` threads (the caller
 * included) in pieces of `piece` bytes. `first` has count + 1 entries (see struct job). Returns 0, or the
 * error of starting a thread (nothing was copied then). */
int gpufeed_copy(char *const *dst, char *const *src, const size_t *len, const size_t *first, int count,
                 size_t piece, int threads) {
    struct job j = {.dst = dst, .src = src, .len = len, .first = first, .count = count, .piece = piece};
    atomic_init(&j.next, 0);
    if (threads <= 1) { /* too little to wake the team for */
        run(&j);
        return 0;
    }
    pthread_mutex_lock(&call_mu);
    int rc = grow(threads);
    if (rc != 0) {
        pthread_mutex_unlock(&call_mu);
        return rc;
    }
    pthread_mutex_lock(&mu);
    current = &j;
    team_want = threads - 1;
    running = team_size;
    generation++;
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&mu);
    run(&j);
    pthread_mutex_lock(&mu);
    while (running > 0) pthread_cond_wait(&done, &mu);
    current = NULL;
    pthread_mutex_unlock(&mu);
    pthread_mutex_unlock(&call_mu);
    return 0;
}

/* The CUDA driver's cuMemcpyHtoDAsync_v2 and cuEventRecord (CUresult, CUdeviceptr, CUstream, CUevent),
 * passed in by the caller from libcuda.so.1, which torch has loaded: this file needs no CUDA headers. */
typedef int (*memcpy_h2d_fn)(unsigned long long dst, const void *src, size_t n, void *stream);
typedef int (*event_record_fn)(void *event, void *stream);

/* Stage `nchunks` chunks through pinned buffers in one call, so the calling thread neither returns to
 * Python nor takes the GIL between them. Chunk c: copy its segments seg_first[c] .. seg_first[c+1]-1
 * (dst, src, len as for gpufeed_copy; its piece index array starts at first + seg_first[c] + c) on the
 * team; then, on the calling thread, issue its host-to-device copies copy_first[c] .. copy_first[c+1]-1
 * (cp_dev <- cp_host, cp_len bytes) on `stream` and record events[c] behind them. Chunk c + 1 is filled
 * while chunk c is on the link. Returns 0; or the CUresult of the call that failed (its chunk in
 * *failed; chunks before it were issued), or -errno when the team could not start (nothing issued). */
int gpufeed_stage(int nchunks, const int *seg_first, char *const *dst, char *const *src, const size_t *len,
                  const size_t *first, size_t piece, int threads, const int *copy_first,
                  const unsigned long long *cp_dev, char *const *cp_host, const size_t *cp_len,
                  void *const *events, void *stream, memcpy_h2d_fn h2d, event_record_fn record, int *failed) {
    for (int c = 0; c < nchunks; c++) {
        int a = seg_first[c], count = seg_first[c + 1] - a;
        if (count > 0) {
            int rc = gpufeed_copy(dst + a, src + a, len + a, first + a + c, count, piece, threads);
            if (rc != 0) {
                *failed = c;
                return -rc;
            }
        }
        for (int k = copy_first[c]; k < copy_first[c + 1]; k++) {
            int rc = h2d(cp_dev[k], cp_host[k], cp_len[k], stream);
            if (rc != 0) {
                *failed = c;
                return rc;
            }
        }
        int rc = record(events[c], stream);
        if (rc != 0) {
            *failed = c;
            return rc;
        }
    }
    return 0;
}

static void before_fork(void) { pthread_mutex_lock(&call_mu); }
static void after_fork_parent(void) { pthread_mutex_unlock(&call_mu); }
static void after_fork_child(void) { pthread_mutex_init(&call_mu, NULL); }

__attribute__((constructor)) static void init(void) {
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}
