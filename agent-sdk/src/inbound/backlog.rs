//! The order in which core messages waiting for a handler slot are taken: by priority
//! (critical, high, normal, low), in arrival order within a priority, with a bound on how long
//! a lower one waits. Pure: no I/O, no clock, so the rule is unit-tested on its own.

use std::collections::VecDeque;

use crate::protocol::envelope::Priority;

/// How many times in a row the message that has waited longest may be overtaken by a later one
/// of a higher priority; the next slot is then its own. Under a steady stream of higher ones,
/// lower messages still get one slot in `MAX_OVERTAKES + 1`.
pub(crate) const MAX_OVERTAKES: u32 = 8;

/// The priority classes, most urgent first: where a message of each priority waits.
pub(crate) const CLASSES: usize = 4;

/// A class's queue keeps this much room when it empties; more is given back, so a burst of
/// one priority does not hold memory after it has drained.
const KEPT_ROOM: usize = 64;

/// The class of `priority`: 0 is served first ([`Priority::rank`]).
pub(crate) fn class(priority: Priority) -> usize {
    priority.rank()
}

/// A bounded queue of waiting items, each with a priority.
#[derive(Debug)]
pub(crate) struct Backlog<T> {
    /// Per class, its items in arrival order, each with its arrival number.
    classes: [VecDeque<(u64, T)>; CLASSES],
    /// The next arrival number.
    arrivals: u64,
    /// Items taken in a row ahead of the one that had waited longest.
    overtakes: u32,
    len: usize,
    capacity: usize,
}

impl<T> Backlog<T> {
    /// An empty backlog holding at most `capacity` items (at least one).
    pub(crate) fn new(capacity: usize) -> Self {
        Backlog {
            classes: Default::default(),
            arrivals: 0,
            overtakes: 0,
            len: 0,
            capacity: capacity.max(1),
        }
    }

    /// Items waiting.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Adds `item` behind the others of its priority; a full backlog gives it back.
    pub(crate) fn push(&mut self, priority: Priority, item: T) -> Result<(), T> {
        if self.len >= self.capacity {
            return Err(item);
        }
        self.classes[class(priority)].push_back((self.arrivals, item));
        self.arrivals += 1;
        self.len += 1;
        Ok(())
    }

    /// Takes the next item: the first of the most urgent class, unless the item that has
    /// waited longest was overtaken [`MAX_OVERTAKES`] times in a row, which then goes.
    pub(crate) fn pop(&mut self) -> Option<T> {
        let urgent = self.classes.iter().position(|q| !q.is_empty())?;
        let oldest = self
            .classes
            .iter()
            .enumerate()
            .filter_map(|(i, q)| q.front().map(|(n, _)| (*n, i)))
            .min()
            .map_or(urgent, |(_, i)| i);
        let from = if urgent == oldest || self.overtakes >= MAX_OVERTAKES {
            self.overtakes = 0;
            oldest
        } else {
            self.overtakes += 1;
            urgent
        };
        let queue = &mut self.classes[from];
        let (_, item) = queue.pop_front()?;
        if queue.is_empty() && queue.capacity() > KEPT_ROOM {
            queue.shrink_to(KEPT_ROOM);
        }
        self.len -= 1;
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Takes everything, in the order it comes out.
    fn drain<T>(backlog: &mut Backlog<T>) -> Vec<T> {
        std::iter::from_fn(|| backlog.pop()).collect()
    }

    #[test]
    fn an_empty_backlog_gives_nothing() {
        let mut b = Backlog::<u32>::new(4);
        assert_eq!(b.pop(), None);
        assert_eq!(b.len(), 0);
    }

    #[test]
    fn one_priority_comes_out_in_arrival_order() {
        let mut b = Backlog::new(100);
        for n in 0..50 {
            b.push(Priority::Normal, n).expect("room");
        }
        assert_eq!(drain(&mut b), (0..50).collect::<Vec<_>>());
    }

    #[test]
    fn critical_then_high_then_normal_then_low() {
        let mut b = Backlog::new(16);
        b.push(Priority::Low, "low").expect("room");
        b.push(Priority::Normal, "normal").expect("room");
        b.push(Priority::High, "high").expect("room");
        b.push(Priority::Critical, "critical").expect("room");
        b.push(Priority::Unknown, "unknown is normal")
            .expect("room");
        assert_eq!(
            drain(&mut b),
            ["critical", "high", "normal", "unknown is normal", "low"]
        );
    }

    #[test]
    fn a_high_one_behind_a_backlog_goes_first() {
        let mut b = Backlog::new(64);
        for n in 0..20 {
            let priority = if n % 2 == 0 {
                Priority::Normal
            } else {
                Priority::Low
            };
            b.push(priority, n).expect("room");
        }
        b.push(Priority::High, 99).expect("room");
        assert_eq!(b.pop(), Some(99));
    }

    #[test]
    fn a_full_backlog_gives_the_item_back_whatever_its_priority() {
        let mut b = Backlog::new(2);
        b.push(Priority::Low, 1).expect("room");
        b.push(Priority::Low, 2).expect("room");
        assert_eq!(b.push(Priority::Critical, 3), Err(3));
        assert_eq!(b.len(), 2);
        assert_eq!(b.pop(), Some(1));
        b.push(Priority::Critical, 3).expect("room again");
        assert_eq!(drain(&mut b), [3, 2]);
    }

    /// The bound: a low message is overtaken at most `MAX_OVERTAKES` times in a row, however
    /// many high ones keep coming.
    #[test]
    fn a_low_one_gets_through_a_steady_stream_of_high_ones() {
        let mut b = Backlog::new(1000);
        b.push(Priority::Low, u32::MAX).expect("room");
        let mut next = 0;
        let mut order = Vec::new();
        for _ in 0..=MAX_OVERTAKES {
            // Two high ones arrive for every one taken: the stream never runs dry.
            for _ in 0..2 {
                b.push(Priority::High, next).expect("room");
                next += 1;
            }
            order.push(b.pop().expect("waiting"));
        }
        assert_eq!(order.len() as u32, MAX_OVERTAKES + 1);
        assert_eq!(order.last(), Some(&u32::MAX), "{order:?}");
        assert!(order[..order.len() - 1].iter().all(|n| *n != u32::MAX));
    }

    /// Every message is taken within a bound whatever arrives behind it: those that were
    /// waiting before it, plus one, times `MAX_OVERTAKES + 1`.
    #[test]
    fn no_message_waits_past_the_bound() {
        let mut b = Backlog::new(10_000);
        // A backlog of normal and low, then a steady stream of critical ones.
        for n in 0..10u32 {
            let priority = if n < 5 {
                Priority::Normal
            } else {
                Priority::Low
            };
            b.push(priority, n).expect("room");
        }
        let mut taken = 0u32;
        let mut seen = [false; 10];
        let mut next = 100u32;
        while seen.iter().any(|s| !s) {
            b.push(Priority::Critical, next).expect("room");
            next += 1;
            let item = b.pop().expect("waiting");
            taken += 1;
            if item < 10 {
                seen[item as usize] = true;
                // Item n had n items ahead of it when it came.
                assert!(
                    taken <= (item + 1) * (MAX_OVERTAKES + 1),
                    "item {item} taken at {taken}"
                );
            }
        }
    }

    #[test]
    fn a_drained_class_gives_its_room_back() {
        let mut b = Backlog::new(10_000);
        for n in 0..5000 {
            b.push(Priority::Low, n).expect("room");
        }
        drain(&mut b);
        assert!(b.classes[class(Priority::Low)].capacity() <= KEPT_ROOM);
    }
}
