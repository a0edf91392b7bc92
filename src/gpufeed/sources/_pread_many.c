/* pread_many: many positional reads in one call, shared among a pool of native threads, and the same reads
 * started without waiting (submit, then wait); gather: rows copied out of a memory map, a file that shrinks
 * under it raising an error instead of killing the process; and resident: whether rows of a memory map lie
 * in the page cache, which decides between the two.
 *
 * Loaded with ctypes (sources/_pread.py), which releases the GIL for the whole call: a batch's reads cost
 * one GIL handoff, however many they are and however many threads read them. Plain C, POSIX threads (plus
 * Linux's preadv2 where the headers have it), no CPython API, so one build serves every Python version.
 * Built by hatch_build.py when the package is built; where it could not be built, gpufeed reads with
 * os.preadv from Python instead.
 */
#define _GNU_SOURCE          /* preadv2 and RWF_NOWAIT (Linux) */
#define _FILE_OFFSET_BITS 64 /* 64-bit off_t on 32-bit platforms too: files past 2 GiB */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

/* Read the bytes of one read from `done` on, resuming short reads and retrying EINTR. 0 when whole; else -1,
 * with status[0] = errno (0 when the file ended first) and status[1] = the bytes read. */
static int read_rest(int fd, char *to, int64_t size, int64_t offset, int64_t done, int64_t *status)
{
    while (done < size) {
        ssize_t got = pread(fd, to + done, (size_t)(size - done), (off_t)(offset + done));
        if (got > 0) {
            done += got;
            continue;
        }
        if (got < 0 && errno == EINTR)
            continue;
        status[0] = got < 0 ? errno : 0;
        status[1] = done;
        return -1;
    }
    return 0;
}

/* The first pass of a read-ahead call: copy what the page cache holds without blocking, and ask the kernel
 * to start reading every other byte now (posix_fadvise WILLNEED), so that all of a cold batch's reads are
 * in flight at once rather than one per thread. A read the cache holds costs one syscall, as without it.
 * Reads shorter than a page are left to the second pass: a blocking read of a missing page also reads the
 * kernel's window around it, which serves the small reads near it, where an advice reads just the page.
 * Errors are left to the second pass, which meets them again in order. */
#ifdef RWF_NOWAIT
static void read_cached_and_advise(const int32_t *fds, const int64_t *offsets, const int64_t *sizes,
                                   char *base, const int64_t *dst, int64_t n, int64_t *done)
{
    const int64_t page = sysconf(_SC_PAGESIZE);
    for (int64_t i = 0; i < n; i++) {
        if (sizes[i] < page)
            continue;
        struct iovec iov = {base + dst[i], (size_t)sizes[i]};
        ssize_t got = preadv2(fds[i], &iov, 1, (off_t)offsets[i], RWF_NOWAIT);
        if (got < 0 && (errno == EOPNOTSUPP || errno == ENOSYS || errno == EINVAL || errno == EPERM))
            return; /* no non-blocking buffered reads here (or a seccomp filter refuses preadv2) */
        if (got > 0)
            done[i] = got;
        if (got != 0 && done[i] < sizes[i]) /* 0: the file ended, nothing to read ahead */
            posix_fadvise(fds[i], (off_t)(offsets[i] + done[i]), (off_t)(sizes[i] - done[i]),
                          POSIX_FADV_WILLNEED);
    }
}
#endif

/* The reads of one thread: sizes[i] bytes at offsets[i] of fds[i] into base + dst[i], for i in 0..n-1, as
 * gpufeed_pread_many describes, the reads after a failed one left unread. */
static int64_t read_all(const int32_t *fds, const int64_t *offsets, const int64_t *sizes, char *base,
                        const int64_t *dst, int64_t n, int64_t *status, int64_t ahead)
{
    int64_t *done = NULL;
#ifdef RWF_NOWAIT
    if (ahead && (done = calloc((size_t)n, sizeof(int64_t))) != NULL)
        read_cached_and_advise(fds, offsets, sizes, base, dst, n, done);
#else
    (void)ahead; /* no non-blocking buffered reads in these headers: one blocking pass */
#endif
    int64_t bad = -1;
    for (int64_t i = 0; i < n && bad < 0; i++)
        if (read_rest(fds[i], base + dst[i], sizes[i], offsets[i], done ? done[i] : 0, status) < 0)
            bad = i;
    free(done);
    return bad;
}

/* The threads that read the shares of a call: started on first use, in each process (a forked child has
 * none of its parent's and starts its own), and kept for the process's life, so a call costs a wake-up
 * per share rather than a thread start. The calling thread reads a share too and then, while its others
 * are still queued, takes queued shares itself (its own or another call's): a call never waits on a
 * share no thread is reading. */
typedef struct {
    void *(*run)(void *);
    void *arg;
    int64_t *left; /* the calling thread's count of its shares not done yet */
} task_t;

#define POOL_MAX 256
#define QUEUE_MAX 1024
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_work = PTHREAD_COND_INITIALIZER; /* a task was queued */
static pthread_cond_t pool_done = PTHREAD_COND_INITIALIZER; /* a call's last share is done */
static task_t queue_[QUEUE_MAX];
static int64_t queued, head; /* queue_[head .. head + queued) (mod QUEUE_MAX) */
static int64_t workers;
static pthread_once_t set_up = PTHREAD_ONCE_INIT;

static int64_t generation; /* a forked child's pool is a new one: tickets of its parent's are not its */

static void monotonic_done(void)
{ /* waits with a deadline measure it on the monotonic clock: a change of the wall clock moves none */
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&pool_done, &attr);
    pthread_condattr_destroy(&attr);
}
static void pool_lock_all(void) { pthread_mutex_lock(&pool_lock); }
static void pool_unlock_all(void) { pthread_mutex_unlock(&pool_lock); }
static void pool_reset_in_child(void)
{ /* the child has this thread only: no worker, and no call but its own in flight */
    pthread_mutex_init(&pool_lock, NULL);
    pthread_cond_init(&pool_work, NULL);
    monotonic_done();
    queued = head = workers = 0;
    generation++;
}
static void pool_setup(void)
{
    monotonic_done();
    pthread_atfork(pool_lock_all, pool_unlock_all, pool_reset_in_child);
}

/* Run one queued task (the lock held, and released while it runs). */
static void run_one(void)
{
    task_t t = queue_[head];
    head = (head + 1) % QUEUE_MAX;
    queued--;
    pthread_mutex_unlock(&pool_lock);
    t.run(t.arg);
    pthread_mutex_lock(&pool_lock);
    if (--*t.left == 0)
        pthread_cond_broadcast(&pool_done);
}

static void *pool_worker(void *unused)
{
    (void)unused;
    pthread_mutex_lock(&pool_lock);
    for (;;) {
        while (queued == 0)
            pthread_cond_wait(&pool_work, &pool_lock);
        run_one();
    }
    return NULL;
}

/* Queue run(arg + i * size) for i in first..count-1 on the pool, grown to `workers_wanted` threads where it
 * has fewer, each task counted in *left; returns the first i the queue had no room (or no worker) for,
 * which the caller runs itself. */
static int64_t queue_shares(void *(*run)(void *), char *arg, size_t size, int64_t first, int64_t count,
                            int64_t workers_wanted, int64_t *left)
{
    pthread_once(&set_up, pool_setup);
    pthread_mutex_lock(&pool_lock);
    while (workers < workers_wanted && workers < POOL_MAX) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int started = pthread_create(&t, &attr, pool_worker, NULL) == 0;
        pthread_attr_destroy(&attr);
        if (!started)
            break;
        workers++;
    }
    int64_t i = first;
    for (; i < count && queued < QUEUE_MAX && workers > 0; i++, ++*left, queued++)
        queue_[(head + queued) % QUEUE_MAX] = (task_t){run, arg + i * size, left};
    pthread_cond_broadcast(&pool_work);
    pthread_mutex_unlock(&pool_lock);
    return i;
}

/* Wait until *left is 0, running this call's own tasks that are still queued; with deadline != NULL,
 * give up at it: 0 when done, -1 when the deadline passed first. */
static int wait_shares(int64_t *left, const struct timespec *deadline)
{
    int done = 0;
    pthread_mutex_lock(&pool_lock);
    while (*left > 0) {
        if (queued > 0 && queue_[head].left == left) {
            run_one();
        } else if (deadline == NULL) {
            pthread_cond_wait(&pool_done, &pool_lock);
        } else if (pthread_cond_timedwait(&pool_done, &pool_lock, deadline) == ETIMEDOUT && *left > 0) {
            done = -1;
            break;
        }
    }
    pthread_mutex_unlock(&pool_lock);
    return done;
}

/* Run run(arg + i * size) for i in 0..count-1: the first here, the others on the pool (or here too, where
 * it cannot take them), and return when all are done. */
static void run_shares(void *(*run)(void *), char *arg, size_t size, int64_t count)
{
    int64_t left = 0;
    for (int64_t j = queue_shares(run, arg, size, 1, count, count - 1, &left); j < count; j++)
        run(arg + j * size);
    run(arg);
    wait_shares(&left, NULL);
}

/* One thread's share of a call: its segments (reads, or parts of one cut at a share's edge), each with the
 * read it belongs to (read) and the bytes of that read before it (before). */
typedef struct {
    int32_t *fds;
    int64_t *offsets, *sizes, *dst, *read, *before;
    char *base;
    int64_t n, ahead, bad, status[2];
} share_t;

static void *read_share(void *arg)
{
    share_t *s = arg;
    s->bad = read_all(s->fds, s->offsets, s->sizes, s->base, s->dst, s->n, s->status, s->ahead);
    return NULL;
}

/* Cut the n reads into shares of about equal bytes, at most `threads`, none under min_share bytes (unless it
 * is the only one). Every share points into one set of segment arrays, seg, of at least n + threads rows:
 * fds, offsets, sizes, dst, read, before. Returns the number of shares. */
static int64_t cut_shares(const int32_t *fds, const int64_t *offsets, const int64_t *sizes, char *base,
                          const int64_t *dst, int64_t n, int64_t threads, int64_t min_share, int64_t ahead,
                          int64_t *seg, share_t *shares)
{
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++)
        total += sizes[i];
    int64_t count = min_share > 0 ? total / min_share : threads;
    count = count < 1 ? 1 : (count > threads ? threads : count);
    const int64_t per = (total + count - 1) / count;
    int64_t rows = n + count, k = 0, used = 0, s = 0; /* k: segments made; used: bytes in share s */
    int32_t *sfd = (int32_t *)(seg + 5 * rows);
    int64_t *soff = seg, *ssize = seg + rows, *sdst = seg + 2 * rows, *sread = seg + 3 * rows,
            *sbefore = seg + 4 * rows;
    shares[0] = (share_t){sfd, soff, ssize, sdst, sread, sbefore, base, 0, ahead, -1, {0, 0}};
    for (int64_t i = 0; i < n; i++) {
        for (int64_t at = 0; at < sizes[i] || (sizes[i] == 0 && at == 0);) {
            if (used >= per && s + 1 < count) { /* this share is full: the next one starts here */
                s++;
                used = 0;
                shares[s] = (share_t){sfd + k, soff + k, ssize + k, sdst + k, sread + k, sbefore + k,
                                      base, 0, ahead, -1, {0, 0}};
            }
            int64_t take = sizes[i] - at;
            if (s + 1 < count && take > per - used)
                take = per - used;
            sfd[k] = fds[i], soff[k] = offsets[i] + at, ssize[k] = take, sdst[k] = dst[i] + at;
            sread[k] = i, sbefore[k] = at;
            k++, shares[s].n++, used += take, at += take;
            if (take == 0)
                break;
        }
    }
    return s + 1;
}

/* Reads in flight on the pool (gpufeed_pread_submit), until gpufeed_pread_free. */
typedef struct {
    int64_t left, count, generation, done, bad, status[2];
    int64_t *seg;      /* the shares' segments, in the same allocation, after the shares */
    share_t shares[];  /* as many as the threads asked for */
} ticket_t;

/* Start the reads gpufeed_pread_many (below) makes, on the pool's threads, and return at once: a ticket for
 * gpufeed_pread_wait, to be freed with gpufeed_pread_free once waited for. The memory at base + dst[i] must
 * stay valid until then; the arrays are copied. NULL when the reads cannot be queued (no memory): read them
 * with gpufeed_pread_many instead. Where the queue is full, or no thread could start, the reads that did
 * not fit are made before it returns. */
void *gpufeed_pread_submit(const int32_t *fds, const int64_t *offsets, const int64_t *sizes, char *base,
                           const int64_t *dst, int64_t n, int64_t ahead, int64_t threads, int64_t min_share)
{
    threads = threads < 1 ? 1 : (threads > 256 ? 256 : threads);
    size_t head = (sizeof(ticket_t) + (size_t)threads * sizeof(share_t) + 7) & ~(size_t)7;
    ticket_t *t = malloc(head + (size_t)(n + threads) * (5 * sizeof(int64_t) + sizeof(int32_t)));
    if (t == NULL)
        return NULL;
    memset(t, 0, sizeof *t);
    t->seg = (int64_t *)((char *)t + head);
    pthread_once(&set_up, pool_setup);
    pthread_mutex_lock(&pool_lock);
    t->generation = generation;
    pthread_mutex_unlock(&pool_lock);
    t->count = n > 0 ? cut_shares(fds, offsets, sizes, base, dst, n, threads, min_share, ahead, t->seg,
                                  t->shares) : 0;
    int64_t j = queue_shares(read_share, (char *)t->shares, sizeof(share_t), 0, t->count, t->count, &t->left);
    for (; j < t->count; j++)
        read_share(&t->shares[j]);
    return t;
}

/* Wait for the reads of a ticket of gpufeed_pread_submit: as gpufeed_pread_many returns, and the same again
 * on a later call. With timeout_us >= 0, -3 when they are not done by then; -4 for a ticket of the process
 * this one was forked from (its reads are not this process's). */
int64_t gpufeed_pread_wait(void *ticket, int64_t *status, int64_t timeout_us)
{
    ticket_t *t = ticket;
    if (!t->done) {
        pthread_mutex_lock(&pool_lock);
        int stale = t->generation != generation;
        pthread_mutex_unlock(&pool_lock);
        if (stale)
            return -4;
        struct timespec deadline;
        if (timeout_us >= 0) {
            clock_gettime(CLOCK_MONOTONIC, &deadline);
            int64_t ns = deadline.tv_nsec + (timeout_us % 1000000) * 1000;
            deadline.tv_sec += timeout_us / 1000000 + ns / 1000000000;
            deadline.tv_nsec = ns % 1000000000;
        }
        if (wait_shares(&t->left, timeout_us >= 0 ? &deadline : NULL) != 0)
            return -3;
        t->bad = -1;
        for (int64_t s = 0; s < t->count; s++) {
            share_t *sh = &t->shares[s];
            if (sh->bad >= 0 && (t->bad < 0 || sh->read[sh->bad] < t->bad)) {
                t->bad = sh->read[sh->bad];
                t->status[0] = sh->status[0];
                t->status[1] = sh->before[sh->bad] + sh->status[1];
            }
        }
        t->done = 1;
    }
    status[0] = t->status[0];
    status[1] = t->status[1];
    return t->bad;
}

/* Free a ticket whose wait returned (or one of the process this one was forked from). */
void gpufeed_pread_free(void *ticket)
{
    free(ticket);
}

/* Read sizes[i] bytes at offsets[i] of fds[i] into base + dst[i], for i in 0..n-1.
 *
 * The bytes are shared among up to `threads` threads (the pool's, this one taking its own queued shares
 * while it waits), none given less than min_share bytes: a batch read from the page cache is a memory copy,
 * and one thread copies a few GB/s. With ahead != 0, each share's first pass reads the cached bytes and
 * starts the kernel's reads of the rest (read_cached_and_advise); its reads then complete in order. Returns
 * -1 when every read is whole; else the index of the first read that is not, with status[0] = its errno (0
 * when the file ended first) and status[1] = the bytes of it that were read. Within a share, no read after
 * a failed one is issued, except by the first pass. */
int64_t gpufeed_pread_many(const int32_t *fds, const int64_t *offsets, const int64_t *sizes, char *base,
                           const int64_t *dst, int64_t n, int64_t *status, int64_t ahead, int64_t threads,
                           int64_t min_share)
{
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++)
        total += sizes[i];
    int shared = threads > 1 && n > 0 && total >= 2 * min_share; /* else one share: read here */
    void *t = shared ? gpufeed_pread_submit(fds, offsets, sizes, base, dst, n, ahead, threads, min_share) : NULL;
    if (t == NULL)
        return read_all(fds, offsets, sizes, base, dst, n, status, ahead);
    int64_t bad = gpufeed_pread_wait(t, status, -1);
    gpufeed_pread_free(t);
    return bad;
}

/* A page of a mapping past the end of its file raises SIGBUS when touched (the file was cut after it was
 * mapped). While a thread gathers, its SIGBUS jumps back into gpufeed_gather, which reports the row. Any other
 * fault is handed back: the handler that was there before ours is restored and the access, which faults
 * again on return, reaches it (the default one ends the process, as without gpufeed). A handler that passes
 * it back to ours (one installed after ours, such as faulthandler enabled later) gets the default action the
 * second time, so the two never pass it back and forth. A SIGBUS sent by a process, which no access repeats,
 * goes to that handler directly. `gathering` is this thread's way back; volatile, since only the handler
 * reads it, so the stores around the copy stay. No lock: two threads installing at once install the same. */
static __thread sigjmp_buf *volatile gathering;
static struct sigaction before; /* the SIGBUS handler ours hands other faults to */
static volatile sig_atomic_t handed_back; /* a fault outside a gather went back to `before` already */

static volatile sig_atomic_t passing; /* a sent SIGBUS is in the handler that was there before ours */

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    sigjmp_buf *back = gathering;
    if (back != NULL)
        siglongjmp(*back, 1);
    if (info != NULL && info->si_code > 0) { /* a fault: hand it back, once */
        if (handed_back) {
            signal(SIGBUS, SIG_DFL);
        } else {
            handed_back = 1;
            sigaction(SIGBUS, &before, NULL);
        }
        return;
    }
    /* Sent by a process (raise, kill): no access repeats it, so call that handler here. */
    if (handed_back || passing || before.sa_handler == SIG_DFL) { /* (a union with sa_sigaction) */
        signal(SIGBUS, SIG_DFL);
        raise(SIGBUS);
        return;
    }
    if (before.sa_handler == SIG_IGN)
        return;
    passing = 1;
    if (before.sa_flags & SA_SIGINFO)
        before.sa_sigaction(sig, info, context);
    else
        before.sa_handler(sig);
    passing = 0;
}

/* Make on_sigbus the SIGBUS handler, unless it is already (a library may have set its own since). */
static int own_sigbus(void)
{
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0)
        return -1;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus)
        return 0;
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&ours.sa_mask);
    before = now;
    handed_back = 0;
    return sigaction(SIGBUS, &ours, NULL);
}

/* Copy the row_bytes at base + offsets[i] to out + i * row_bytes, for i in 0..n-1, on this thread. */
static int64_t gather_here(const char *base, const int64_t *offsets, int64_t n, int64_t row_bytes, char *out)
{
    sigjmp_buf back;
    volatile int64_t i = 0;
    if (sigsetjmp(back, 1) != 0) { /* a page past the end of the file: row i */
        gathering = NULL;
        return i;
    }
    gathering = &back;
    for (; i < n; i++)
        memcpy(out + i * row_bytes, base + offsets[i], (size_t)row_bytes);
    gathering = NULL;
    return -1;
}

typedef struct {
    const char *base;
    const int64_t *offsets;
    int64_t n, row_bytes, bad;
    char *out;
} rows_t;

static void *gather_share(void *arg)
{
    rows_t *r = arg;
    r->bad = gather_here(r->base, r->offsets, r->n, r->row_bytes, r->out);
    return NULL;
}

/* Copy the row_bytes at base + offsets[i] to out + i * row_bytes, for i in 0..n-1, base being a read-only
 * memory map, the rows shared among up to `threads` threads (none given less than min_share bytes). Returns
 * -1 when every row is copied; else the index of the first row whose page lay past the end of its file (it
 * shrank after it was mapped); -2 when the SIGBUS handler could not be set (nothing copied). */
int64_t gpufeed_gather(const char *base, const int64_t *offsets, int64_t n, int64_t row_bytes, char *out,
                       int64_t threads, int64_t min_share)
{
    if (own_sigbus() != 0)
        return -2;
    int64_t count = min_share > 0 ? n * row_bytes / min_share : threads;
    count = count < 1 ? 1 : (count > threads ? threads : count);
    count = count > 256 ? 256 : (count > n ? n : count);
    if (count <= 1)
        return gather_here(base, offsets, n, row_bytes, out);
    rows_t shares[256];
    const int64_t per = (n + count - 1) / count;
    for (int64_t s = 0; s < count; s++) {
        int64_t a = s * per < n ? s * per : n, b = a + per < n ? a + per : n;
        shares[s] = (rows_t){base, offsets + a, b - a, row_bytes, -1, out + a * row_bytes};
    }
    run_shares(gather_share, (char *)shares, sizeof(rows_t), count);
    int64_t bad = -1;
    for (int64_t s = 0; s < count; s++) {
        if (shares[s].bad >= 0 && bad < 0)
            bad = s * per + shares[s].bad;
    }
    return bad;
}

/* Whether the page cache holds the first page of the row_bytes at base + offsets[i], for every i in 0..n-1,
 * base being a memory map of size bytes: 1 when it does, else 0 (a row past size, a page the cache lacks, or
 * mincore failing). One mincore call a row (about a microsecond) and no page touched: nothing faults in. */
int64_t gpufeed_resident(const char *base, int64_t size, const int64_t *offsets, int64_t n, int64_t row_bytes)
{
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    for (int64_t i = 0; i < n; i++) {
        if (offsets[i] < 0 || row_bytes < 1 || offsets[i] + row_bytes > size)
            return 0;
        unsigned char in_cache = 0;
        if (mincore((void *)((uintptr_t)(base + offsets[i]) & ~(page - 1)), page, &in_cache) != 0)
            return 0;
        if (!(in_cache & 1))
            return 0;
    }
    return 1;
}

/* The calling convention above; _pread.py loads a library only when this matches what it was written for,
 * so a library left from an older build is never called with other arguments. */
int64_t gpufeed_pread_abi(void) { return 7; }
