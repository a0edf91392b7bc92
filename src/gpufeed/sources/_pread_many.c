/* pread_many: many positional reads in one call, for gpufeed's reader threads.
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
#include <stdint.h>
#include <stdlib.h>
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

/* The calling convention above; _pread.py loads a library only when this matches what it was written for,
 * so a library left from an older build is never called with other arguments. */
int64_t gpufeed_pread_abi(void) { return 2; }
