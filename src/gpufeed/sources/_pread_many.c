/* pread_many: many positional reads in one call, for gpufeed's reader threads; gather: rows copied out of a
 * memory map, a file that shrinks under it raising an error instead of killing the process; and resident:
 * whether rows of a memory map lie in the page cache, which decides between the two.
 *
 * Loaded with ctypes (sources/_pread.py), which releases the GIL for the whole call: a shuffled batch's
 * thousands of reads cost one GIL handoff per piece instead of one per read. Plain C and POSIX (plus Linux's
 * preadv2 where the headers have it), no CPython API, so one build serves every Python version. Built by
 * hatch_build.py when the package is built; where it could not be built, gpufeed reads with os.preadv from
 * Python instead.
 */
#define _GNU_SOURCE          /* preadv2 and RWF_NOWAIT (Linux) */
#define _FILE_OFFSET_BITS 64 /* 64-bit off_t on 32-bit platforms too: files past 2 GiB */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

/* Read sizes[i] bytes at offsets[i] of fds[i] into base + dst[i], for i in 0..n-1.
 *
 * With ahead != 0, a first pass reads the cached bytes and starts the kernel's reads of the rest
 * (read_cached_and_advise); the reads then complete in order. Returns -1 when every read is whole; else the
 * index of the first read that is not, with status[0] = its errno (0 when the file ended first) and
 * status[1] = the bytes of it that were read. No read after a failed one is issued, except by the first
 * pass. */
int64_t gpufeed_pread_many(const int32_t *fds, const int64_t *offsets, const int64_t *sizes, char *base,
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

/* Copy the row_bytes at base + offsets[i] to out + i * row_bytes, for i in 0..n-1, base being a read-only
 * memory map. Returns -1 when every row is copied; else the index of the row whose page lay past the end of
 * its file (it shrank after it was mapped); -2 when the SIGBUS handler could not be set (nothing copied). */
int64_t gpufeed_gather(const char *base, const int64_t *offsets, int64_t n, int64_t row_bytes, char *out)
{
    sigjmp_buf back;
    volatile int64_t i = 0;
    if (own_sigbus() != 0)
        return -2;
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
int64_t gpufeed_pread_abi(void) { return 4; }
