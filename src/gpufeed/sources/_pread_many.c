/* pread_many: many positional reads in one call, for gpufeed's reader threads.
 *
 * Loaded with ctypes (sources/_pread.py), which releases the GIL for the whole call: a shuffled batch's
 * thousands of reads cost one GIL handoff per piece instead of one per read. Plain C and POSIX only, no
 * CPython API, so one build serves every Python version. Built by hatch_build.py when the package is
 * built; where it could not be built, gpufeed reads with os.preadv from Python instead.
 */
#define _XOPEN_SOURCE 700
#define _FILE_OFFSET_BITS 64 /* 64-bit off_t on 32-bit platforms too: files past 2 GiB */
#include <errno.h>
#include <stdint.h>
#include <unistd.h>

/* Read sizes[i] bytes at offsets[i] of fds[i] into base + dst[i], for i in 0..n-1, in that order.
 *
 * Short reads are resumed and EINTR retried. Returns -1 when every read is whole; else the index of the
 * first read that is not, with status[0] = its errno (0 when the file ended first) and status[1] = the
 * bytes of it that were read. Reads after a failed one are not issued. */
int64_t gpufeed_pread_many(const int32_t *fds, const int64_t *offsets, const int64_t *sizes, char *base,
                           const int64_t *dst, int64_t n, int64_t *status)
{
    for (int64_t i = 0; i < n; i++) {
        int64_t done = 0;
        while (done < sizes[i]) {
            ssize_t got = pread(fds[i], base + dst[i] + done, (size_t)(sizes[i] - done),
                                (off_t)(offsets[i] + done));
            if (got > 0) {
                done += got;
                continue;
            }
            if (got < 0 && errno == EINTR)
                continue;
            status[0] = got < 0 ? errno : 0;
            status[1] = done;
            return i;
        }
    }
    return -1;
}

/* The calling convention above; _pread.py loads a library only when this matches what it was written for,
 * so a library left from an older build is never called with other arguments. */
int64_t gpufeed_pread_abi(void) { return 1; }
