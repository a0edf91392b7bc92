"""The epoch rule every loader keeps: an iteration that hands out a batch is an epoch."""

from __future__ import annotations


class Epochs:
    """A loader's epoch count, as a DataLoader's user keeps it: an iteration that hands out a batch is an
    epoch, and the next iteration a new one unless :meth:`set_epoch` chose one; an ``iter()`` that hands out
    nothing (Lightning's probe) does not count.

    Invariant: ``epoch`` changes only by :meth:`set_epoch` and :meth:`begin_epoch`, on the loop's thread.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self._epoch_set = False  # set_epoch chose the next iteration's epoch
        self._started = False  # a batch of ``epoch`` was handed out: the next iteration is a new epoch

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration."""
        self.epoch, self._epoch_set = int(epoch), True

    def upcoming_epoch(self) -> int:
        """The epoch the next iteration reads: a new one once a batch of the current one was handed out,
        unless :meth:`set_epoch` chose one."""
        return self.epoch + 1 if self._started and not self._epoch_set else self.epoch

    def begin_epoch(self, epoch: int) -> None:
        """A batch of ``epoch`` was handed out: it is the current epoch, and the next iteration a new one."""
        self.epoch, self._started, self._epoch_set = epoch, True, False

    def restart_at(self, epoch: int) -> None:
        """Resumed: ``epoch`` is the next iteration's, and none of it was handed out yet."""
        self.epoch, self._started, self._epoch_set = epoch, False, False
