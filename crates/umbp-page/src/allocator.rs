//! The bitmap page allocator behind every paged medium (reference §4).
//!
//! One word bitmap per buffer (bit set = page used), worked a whole `u64` at a time: full words are
//! skipped with one compare, free bits found with `trailing_zeros`, runs inside a word with a
//! shift-and ladder. Two summaries keep every request cheap however fragmented a buffer gets:
//!
//! - `hint` (every word below it is full) and `nonfull` (one bit per word: has a free page), so
//!   "lowest free pages" scans (single-page first fit, strategies 2 and 3) start at the first word
//!   with a free page and skip full words 64 at a time; single-page allocation is O(1) amortised;
//! - a run-summary tree over the words (per node: free run at its low end, at its high end, and the
//!   longest inside), so contiguous first fit descends to the lowest fitting run in O(log words)
//!   and a buffer with no fitting run is rejected in O(1), instead of scanning every mixed word.
//!   Changed words are queued and folded in before the next contiguous search, level by level and
//!   only above nodes whose summary changed, so single-page traffic never pays for the tree.
//!
//! A contiguous search first scans a few words past the hint (most requests fit there) and consults
//! the tree only when that window is exhausted. None of this changes which pages are chosen: the
//! three strategies are exactly the reference's (a property test compares every choice against a
//! plain `Vec<bool>` model). The allocator has no lock: its owner locks around it.

use umbp_core::PageLocation;

/// Bits per bitmap word.
const WORD_BITS: u64 = u64::BITS as u64;
/// A word whose pages are all used.
const FULL: u64 = u64::MAX;

/// Why a [`PageBitmapAllocator`] could not be built.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AllocatorError {
    /// A page size of zero bytes was given.
    #[error("page size must be greater than zero")]
    ZeroPageSize,
    /// One buffer holds more pages than a [`PageLocation`] can address.
    #[error("buffer {buffer_index} holds {pages} pages, more than the {} a page index can address", u32::MAX)]
    TooManyPages {
        /// The offending buffer.
        buffer_index: usize,
        /// Pages it would hold.
        pages: u64,
    },
}

impl AllocatorError {
    /// What the caller should do next: fix the geometry; no retry builds this allocator.
    pub fn kind(&self) -> umbp_core::ErrorKind {
        match self {
            Self::ZeroPageSize | Self::TooManyPages { .. } => umbp_core::ErrorKind::InvalidInput,
        }
    }
}

/// How many words past the hint a contiguous search scans before consulting the run tree.
const NEAR_HINT_WORDS: usize = 8;

/// What a bounded scan for a run found.
enum Scan {
    /// The lowest run starts here.
    Found(u64),
    /// No run of that length exists.
    Absent,
    /// The window ended first.
    GaveUp,
}

/// Free runs of one subtree, in pages. Every count is at most the buffer's page count, which fits a
/// `u32` (checked by [`PageBitmapAllocator::new`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct RunSummary {
    /// Free pages at the low end.
    low: u32,
    /// Free pages at the high end.
    high: u32,
    /// The longest free run inside.
    best: u32,
}

impl RunSummary {
    fn of_word(word: u64) -> Self {
        Self { low: word.trailing_zeros(), high: word.leading_zeros(), best: longest_run_in_word(!word) }
    }

    /// The summary of two adjacent subtrees of `child_pages` pages each.
    fn merge(low: Self, high: Self, child_pages: u64) -> Self {
        // The sums count distinct free pages of one buffer, so they fit a u32.
        Self {
            low: if u64::from(low.low) == child_pages { low.low + high.low } else { low.low },
            high: if u64::from(high.high) == child_pages { high.high + low.high } else { high.high },
            best: low.best.max(high.best).max(low.high + high.low),
        }
    }
}

/// The bitmap of one buffer.
#[derive(Debug, Clone)]
struct BufferBitmap {
    /// Bit `p % 64` of word `p / 64` is set when page `p` is used. Bits past `total_pages` in the last
    /// word are set too, so a scan never has to bound-check a free bit.
    words: Vec<u64>,
    total_pages: u64,
    free_count: u64,
    /// Bit `i % 64` of entry `i / 64` is set when word `i` has a free page, so a search for the
    /// lowest free page skips 64 full words per step.
    nonfull: Vec<u64>,
    /// Every word below `hint` is full.
    hint: usize,
    /// A complete binary tree of [`RunSummary`], heap-ordered: node 1 is the root, node
    /// `leaves + i` summarises word `i`; leaves past the last word summarise nothing (all used).
    tree: Vec<RunSummary>,
    /// Leaf count: the word count rounded up to a power of two (at least 1).
    leaves: usize,
    /// Words changed since the tree was last brought up to date (see [`flush`](Self::flush)).
    dirty: Vec<u32>,
    /// Too many words changed: rebuild the whole tree instead.
    rebuild_all: bool,
}

impl BufferBitmap {
    fn new(total_pages: u64) -> Self {
        // `total_pages <= u32::MAX` (checked by the caller), so the word count fits a usize.
        let full_words = (total_pages / WORD_BITS) as usize;
        let tail_bits = total_pages % WORD_BITS;
        let mut words = vec![0u64; full_words];
        if tail_bits != 0 {
            words.push(FULL << tail_bits);
        }
        let (tree, leaves) = build_tree(&words);
        let mut nonfull = vec![0u64; words.len().div_ceil(WORD_BITS as usize)];
        for (i, &word) in words.iter().enumerate() {
            if word != FULL {
                nonfull[i / WORD_BITS as usize] |= 1 << (i % WORD_BITS as usize);
            }
        }
        Self {
            words,
            total_pages,
            free_count: total_pages,
            nonfull,
            hint: 0,
            tree,
            leaves,
            dirty: Vec::new(),
            rebuild_all: false,
        }
    }

    /// The longest free run in the buffer.
    fn longest_run(&mut self) -> u64 {
        self.flush();
        u64::from(self.tree[1].best)
    }

    /// Notes that word `index` changed; the tree catches up in [`flush`](Self::flush), so
    /// single-page allocations and frees never pay for it.
    fn mark_dirty(&mut self, index: usize) {
        // Word indexes are below 2^26 (`total_pages <= u32::MAX`), tree nodes below 2^27.
        let index = index as u32;
        if self.rebuild_all || self.dirty.last() == Some(&index) {
            return;
        }
        if self.dirty.len() >= self.words.len() {
            // More pending updates than words: one rebuild is cheaper, and the list stays bounded.
            self.rebuild_all = true;
            self.dirty.clear();
            return;
        }
        self.dirty.push(index);
    }

    /// Brings the run tree up to date with the bitmap, one level at a time so shared ancestors are
    /// recomputed once, and only above nodes whose summary changed.
    fn flush(&mut self) {
        if self.rebuild_all {
            self.rebuild_all = false;
            (self.tree, self.leaves) = build_tree(&self.words);
            return;
        }
        if self.dirty.is_empty() {
            return;
        }
        let mut nodes = std::mem::take(&mut self.dirty);
        nodes.sort_unstable();
        nodes.dedup();
        let mut kept = 0;
        for i in 0..nodes.len() {
            let word = nodes[i] as usize;
            let leaf = self.leaves + word;
            let summary = RunSummary::of_word(self.words[word]);
            if self.tree[leaf] != summary {
                self.tree[leaf] = summary;
                nodes[kept] = leaf as u32;
                kept += 1;
            }
        }
        nodes.truncate(kept);
        let mut child_pages = WORD_BITS;
        // Every node in `nodes` is on the same level, sorted; stop at the root or when none changed.
        while nodes.first().is_some_and(|&n| n > 1) {
            nodes.dedup_by_key(|n| *n / 2);
            let mut kept = 0;
            for i in 0..nodes.len() {
                let node = nodes[i] as usize / 2;
                let merged = RunSummary::merge(self.tree[2 * node], self.tree[2 * node + 1], child_pages);
                if self.tree[node] != merged {
                    self.tree[node] = merged;
                    nodes[kept] = node as u32;
                    kept += 1;
                }
            }
            nodes.truncate(kept);
            child_pages *= 2;
        }
        nodes.clear();
        // Keep the allocation for the next round.
        self.dirty = nodes;
    }

    /// Stores `value` as word `index`, keeping the summaries in step.
    fn set_word(&mut self, index: usize, value: u64) {
        self.words[index] = value;
        let (entry, bit) = (index / WORD_BITS as usize, 1u64 << (index % WORD_BITS as usize));
        if value == FULL {
            self.nonfull[entry] &= !bit;
        } else {
            self.nonfull[entry] |= bit;
        }
        self.mark_dirty(index);
    }

    /// The first word at or after `from` with a free page.
    fn next_nonfull(&self, from: usize) -> Option<usize> {
        let mut entry = from / WORD_BITS as usize;
        let mut bits = *self.nonfull.get(entry)? & (FULL << (from % WORD_BITS as usize));
        loop {
            if bits != 0 {
                return Some(entry * WORD_BITS as usize + bits.trailing_zeros() as usize);
            }
            entry += 1;
            bits = *self.nonfull.get(entry)?;
        }
    }

    /// Moves `hint` to the first word with a free page. A free can pull the hint far down and a
    /// refill leave it on a full word; `nonfull` makes the climb back 64 words a step.
    fn settle_hint(&mut self) {
        if self.words.get(self.hint).is_some_and(|&w| w == FULL) {
            self.hint = self.next_nonfull(self.hint).unwrap_or(self.words.len());
        }
    }

    /// The first page of the lowest run of `n` free pages (`n >= 1`).
    fn find_run(&mut self, n: u64) -> Option<u64> {
        self.settle_hint();
        if n == 1 {
            let word = *self.words.get(self.hint)?;
            return Some(self.hint as u64 * WORD_BITS + u64::from(word.trailing_ones()));
        }
        // Most requests fit just past the hint; look there before bringing the tree up to date.
        match self.scan_for_run(n, NEAR_HINT_WORDS) {
            Scan::Found(start) => return Some(start),
            Scan::Absent => return None,
            Scan::GaveUp => {}
        }
        if self.longest_run() < n {
            return None;
        }
        // Descend to the lowest run: it lies wholly in the low child, or straddles the middle, or
        // lies in the high child, checked in that order (a straddling run starts before anything in
        // the high child and after every run wholly in the low one).
        let mut node = 1;
        let mut start = 0u64;
        let mut pages = self.leaves as u64 * WORD_BITS;
        while node < self.leaves {
            let (low, high) = (self.tree[2 * node], self.tree[2 * node + 1]);
            pages /= 2;
            if u64::from(low.best) >= n {
                node *= 2;
            } else if u64::from(low.high) + u64::from(high.low) >= n {
                return Some(start + pages - u64::from(low.high));
            } else {
                node = 2 * node + 1;
                start += pages;
            }
        }
        // A leaf whose own longest run fits, so `n <= 64`; runs reaching into neighbours were
        // handled above.
        let word = self.words[node - self.leaves];
        let offset = if n == WORD_BITS { Some(0) } else { first_run_in_word(!word, n) };
        debug_assert!(offset.is_some(), "run tree out of sync with the bitmap");
        offset.map(|o| start + o)
    }

    /// Scans at most `max_words` words from the hint for the lowest run of `n >= 2` free pages.
    fn scan_for_run(&self, n: u64, max_words: usize) -> Scan {
        // The free run reaching the top of the previous word.
        let mut run_start = 0u64;
        let mut run_len = 0u64;
        for (i, &w) in self.words.iter().enumerate().skip(self.hint).take(max_words) {
            let base = i as u64 * WORD_BITS;
            if w == FULL {
                run_len = 0;
                continue;
            }
            if run_len == 0 {
                run_start = base;
            }
            // Free pages at the bottom of this word extend the carried run. Runs are met in order, and
            // the carried run is the one being extended, so the first to reach `n` is the lowest.
            run_len += u64::from(w.trailing_zeros());
            if run_len >= n {
                return Scan::Found(run_start);
            }
            if w == 0 {
                continue;
            }
            // Runs strictly inside the word (only one shorter than a word fits); one starting at bit 0
            // was covered above, one reaching bit 63 is found here if long enough.
            if n < WORD_BITS
                && let Some(offset) = first_run_in_word(!w, n)
            {
                return Scan::Found(base + offset);
            }
            let top_free = u64::from(w.leading_zeros());
            run_len = top_free;
            run_start = base + WORD_BITS - top_free;
        }
        // Words below the hint are full, so a scan that reached the end saw every candidate.
        if self.hint.saturating_add(max_words) >= self.words.len() { Scan::Absent } else { Scan::GaveUp }
    }

    /// Marks pages `start..start + n` used; they must be free.
    fn mark_run(&mut self, start: u64, n: u64) {
        let end = start + n;
        let mut page = start;
        while page < end {
            let bit = page % WORD_BITS;
            let span = (WORD_BITS - bit).min(end - page);
            let mask = if span == WORD_BITS { FULL } else { ((1u64 << span) - 1) << bit };
            let index = (page / WORD_BITS) as usize;
            debug_assert_eq!(self.words[index] & mask, 0, "marking a used page");
            self.set_word(index, self.words[index] | mask);
            page += span;
        }
        self.free_count -= n;
    }

    /// Marks the lowest `n` free pages used and appends them to `out`, in value order. `n` must not
    /// exceed `free_count`.
    fn take_lowest(&mut self, buffer_index: u32, n: u64, out: &mut Vec<PageLocation>) {
        debug_assert!(n <= self.free_count);
        self.settle_hint();
        let mut left = n;
        let mut from = self.hint;
        while left > 0
            && let Some(index) = self.next_nonfull(from)
        {
            let word = self.words[index];
            let base = index as u64 * WORD_BITS;
            let mut free = !word;
            if free == FULL && left >= WORD_BITS {
                // Page indexes fit u32: `total_pages <= u32::MAX`.
                out.extend((base..base + WORD_BITS).map(|p| PageLocation::new(buffer_index, p as u32)));
                free = 0;
                left -= WORD_BITS;
            } else {
                while free != 0 && left > 0 {
                    out.push(PageLocation::new(buffer_index, (base + u64::from(free.trailing_zeros())) as u32));
                    free &= free - 1;
                    left -= 1;
                }
            }
            self.set_word(index, !free);
            from = index + 1;
        }
        debug_assert_eq!(left, 0, "free_count out of sync with the bitmap");
        self.free_count -= n - left;
    }

    fn is_used(&self, page: u64) -> bool {
        self.words[(page / WORD_BITS) as usize] & (1u64 << (page % WORD_BITS)) != 0
    }

    /// Frees `page` if it is in range and used; returns whether it was freed.
    fn free(&mut self, page: u64) -> bool {
        if page >= self.total_pages {
            return false;
        }
        let index = (page / WORD_BITS) as usize;
        let bit = 1u64 << (page % WORD_BITS);
        if self.words[index] & bit == 0 {
            return false;
        }
        self.set_word(index, self.words[index] & !bit);
        self.free_count += 1;
        self.hint = self.hint.min(index);
        true
    }
}

/// The run-summary tree of `words` and its leaf count.
fn build_tree(words: &[u64]) -> (Vec<RunSummary>, usize) {
    let leaves = words.len().next_power_of_two();
    let mut tree = vec![RunSummary::default(); 2 * leaves];
    for (i, &word) in words.iter().enumerate() {
        tree[leaves + i] = RunSummary::of_word(word);
    }
    let mut child_pages = WORD_BITS;
    let mut level_start = leaves;
    while level_start > 1 {
        for node in level_start / 2..level_start {
            tree[node] = RunSummary::merge(tree[2 * node], tree[2 * node + 1], child_pages);
        }
        level_start /= 2;
        child_pages *= 2;
    }
    (tree, leaves)
}

/// The longest run of set bits in `free`.
fn longest_run_in_word(mut free: u64) -> u32 {
    let mut best = 0;
    while free != 0 {
        free >>= free.trailing_zeros();
        let run = free.trailing_ones();
        best = best.max(run);
        // `run == 64` only when every bit was set; `checked_shr` turns that into the end.
        free = free.checked_shr(run).unwrap_or(0);
    }
    best
}

/// The lowest bit offset at which `free` has `n` consecutive set bits (`1 <= n < 64`).
fn first_run_in_word(free: u64, n: u64) -> Option<u64> {
    // Invariant: bit p of `x` is set iff bits p..p+len of `free` are all set. Doubling `len` (capped
    // at `n`) takes O(log n) steps; bits shifted in from above are zero, so runs never wrap.
    let mut x = free;
    let mut len = 1;
    while len < n && x != 0 {
        let shift = (n - len).min(len);
        x &= x >> shift;
        len += shift;
    }
    (x != 0).then(|| u64::from(x.trailing_zeros()))
}

/// Hands out pages of a fixed size from a set of buffers, all or nothing (reference §4).
///
/// [`allocate`](Self::allocate) tries, in order:
/// 1. contiguous first fit: the lowest run of `n` free pages in the first buffer (in index order)
///    that has one;
/// 2. else the lowest `n` free pages of the first buffer with at least `n` free pages;
/// 3. else, if the buffers together have `n` free pages, the lowest free pages of each buffer in index
///    order until `n` are taken.
///
/// It has no lock of its own: the owner serialises access.
#[derive(Debug, Clone)]
pub struct PageBitmapAllocator {
    page_size: u64,
    buffers: Vec<BufferBitmap>,
    total_pages: u64,
    free_pages: u64,
}

impl PageBitmapAllocator {
    /// An allocator over buffers of the given sizes: buffer `i` holds `buffer_sizes[i] / page_size`
    /// pages (a remainder is wasted). An empty list is valid and can allocate nothing.
    ///
    /// # Errors
    /// [`AllocatorError::ZeroPageSize`] for a zero page size, [`AllocatorError::TooManyPages`] when
    /// one buffer would hold more than `u32::MAX` pages.
    ///
    /// # Panics
    /// With more than `u32::MAX + 1` buffers (a buffer index must fit a [`PageLocation`]).
    pub fn new(page_size: u64, buffer_sizes: &[u64]) -> Result<Self, AllocatorError> {
        if page_size == 0 {
            return Err(AllocatorError::ZeroPageSize);
        }
        assert!(
            u32::try_from(buffer_sizes.len().saturating_sub(1)).is_ok(),
            "more buffers than a page location can address"
        );
        let buffers = buffer_sizes
            .iter()
            .enumerate()
            .map(|(buffer_index, &size)| {
                let pages = size / page_size;
                if pages > u64::from(u32::MAX) {
                    return Err(AllocatorError::TooManyPages { buffer_index, pages });
                }
                Ok(BufferBitmap::new(pages))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let total_pages = buffers.iter().map(|b| b.total_pages).sum();
        Ok(Self { page_size, buffers, total_pages, free_pages: total_pages })
    }

    /// Reserves `n` pages, all or nothing, returned in the order chosen (see the type docs). `None`
    /// when `n == 0` or they do not fit; `None` changes no page.
    pub fn allocate(&mut self, n: u64) -> Option<Vec<PageLocation>> {
        if n == 0 || n > self.free_pages {
            return None;
        }
        // `n <= free_pages <= total_pages`, and the pages exist in memory as bits, so it fits a usize.
        let mut out = Vec::with_capacity(n as usize);

        // 1. Contiguous first fit.
        for (index, buffer) in self.buffers.iter_mut().enumerate() {
            if buffer.free_count < n {
                continue;
            }
            if let Some(start) = buffer.find_run(n) {
                buffer.mark_run(start, n);
                let buffer_index = index as u32;
                out.extend((start..start + n).map(|p| PageLocation::new(buffer_index, p as u32)));
                self.free_pages -= n;
                return Some(out);
            }
        }

        // 2. The lowest free pages of the first buffer that has enough.
        if let Some((index, buffer)) = self.buffers.iter_mut().enumerate().find(|(_, b)| b.free_count >= n) {
            buffer.take_lowest(index as u32, n, &mut out);
            self.free_pages -= n;
            return Some(out);
        }

        // 3. Scatter across buffers in index order (enough pages are free: checked above).
        let mut left = n;
        for (index, buffer) in self.buffers.iter_mut().enumerate() {
            if left == 0 {
                break;
            }
            let take = left.min(buffer.free_count);
            if take > 0 {
                buffer.take_lowest(index as u32, take, &mut out);
                left -= take;
            }
        }
        debug_assert_eq!(left, 0, "free_pages out of sync with the buffers");
        self.free_pages -= n;
        Some(out)
    }

    /// Frees `pages`. Out-of-range buffer or page indexes and already-free pages are skipped, so
    /// freeing twice is harmless.
    pub fn deallocate(&mut self, pages: &[PageLocation]) {
        for page in pages {
            if let Some(buffer) = self.buffers.get_mut(page.buffer_index as usize)
                && buffer.free(u64::from(page.page_index))
            {
                self.free_pages += 1;
            }
        }
    }

    /// Bytes per page.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// Number of buffers (including ones too small to hold a page).
    pub fn num_buffers(&self) -> usize {
        self.buffers.len()
    }

    /// Pages in buffer `buffer_index`; 0 when out of range.
    pub fn buffer_pages(&self, buffer_index: usize) -> u64 {
        self.buffers.get(buffer_index).map_or(0, |b| b.total_pages)
    }

    /// Pages across all buffers.
    pub fn total_pages(&self) -> u64 {
        self.total_pages
    }

    /// Pages not handed out.
    pub fn free_pages(&self) -> u64 {
        self.free_pages
    }

    /// Bytes across all pages (remainders excluded).
    pub fn total_bytes(&self) -> u64 {
        self.total_pages.saturating_mul(self.page_size)
    }

    /// Bytes of free pages.
    pub fn available_bytes(&self) -> u64 {
        self.free_pages.saturating_mul(self.page_size)
    }

    /// Bytes of pages handed out.
    pub fn used_bytes(&self) -> u64 {
        (self.total_pages - self.free_pages).saturating_mul(self.page_size)
    }

    /// Whether `page` exists and is free.
    pub fn is_free(&self, page: PageLocation) -> bool {
        let index = u64::from(page.page_index);
        self.buffers.get(page.buffer_index as usize).is_some_and(|b| index < b.total_pages && !b.is_used(index))
    }

    /// Whether every buffer's run tree matches its bitmap and its free count its set bits.
    #[cfg(test)]
    fn consistent(&mut self) -> bool {
        self.buffers.iter_mut().for_each(BufferBitmap::flush);
        self.buffers.iter().all(|b| {
            let free: u64 = b.words.iter().map(|w| u64::from(w.count_zeros())).sum();
            let nonfull_ok =
                b.words.iter().enumerate().all(|(i, &w)| {
                    (b.nonfull[i / WORD_BITS as usize] >> (i % WORD_BITS as usize) & 1 == 1) == (w != FULL)
                });
            nonfull_ok
                && build_tree(&b.words).0 == b.tree
                && free == b.free_count
                && b.words[..b.hint].iter().all(|&w| w == FULL)
        }) && self.buffers.iter().map(|b| b.free_count).sum::<u64>() == self.free_pages
    }

    /// The observable state (bitmaps and counters, not the caches), for "nothing changed" checks.
    #[cfg(test)]
    fn state(&self) -> (Vec<(Vec<u64>, u64)>, u64) {
        (self.buffers.iter().map(|b| (b.words.clone(), b.free_count)).collect(), self.free_pages)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn allocator_errors_are_invalid_input() {
        assert_eq!(AllocatorError::ZeroPageSize.kind(), umbp_core::ErrorKind::InvalidInput);
        let too_many = AllocatorError::TooManyPages { buffer_index: 0, pages: u64::MAX };
        assert_eq!(too_many.kind(), umbp_core::ErrorKind::InvalidInput);
    }

    const KIB: u64 = 1024;

    fn loc(buffer_index: u32, page_index: u32) -> PageLocation {
        PageLocation::new(buffer_index, page_index)
    }

    fn locs(pairs: &[(u32, u32)]) -> Vec<PageLocation> {
        pairs.iter().map(|&(b, p)| loc(b, p)).collect()
    }

    #[test]
    fn zero_page_size_is_invalid() {
        assert_eq!(PageBitmapAllocator::new(0, &[4 * KIB]).unwrap_err(), AllocatorError::ZeroPageSize);
    }

    #[test]
    fn too_many_pages_in_one_buffer_is_invalid() {
        let pages = u64::from(u32::MAX) + 1;
        assert_eq!(
            PageBitmapAllocator::new(1, &[8, pages]).unwrap_err(),
            AllocatorError::TooManyPages { buffer_index: 1, pages }
        );
    }

    #[test]
    fn empty_buffer_list_is_valid() {
        let mut a = PageBitmapAllocator::new(KIB, &[]).unwrap();
        assert_eq!(a.num_buffers(), 0);
        assert_eq!((a.total_bytes(), a.available_bytes(), a.used_bytes()), (0, 0, 0));
        assert_eq!(a.allocate(1), None);
        assert_eq!(a.buffer_pages(0), 0);
    }

    #[test]
    fn remainder_is_wasted() {
        let a = PageBitmapAllocator::new(KIB, &[5000, 100]).unwrap();
        assert_eq!(a.buffer_pages(0), 4);
        assert_eq!(a.buffer_pages(1), 0);
        assert_eq!(a.total_pages(), 4);
        assert_eq!(a.total_bytes(), 4 * KIB);
        assert_eq!(a.page_size(), KIB);
        assert!(!a.is_free(loc(0, 4)), "the wasted remainder is not a page");
    }

    #[test]
    fn zero_pages_returns_none_and_consumes_nothing() {
        let mut a = PageBitmapAllocator::new(KIB, &[4 * KIB]).unwrap();
        assert_eq!(a.allocate(0), None);
        assert_eq!(a.free_pages(), 4);
    }

    #[test]
    fn single_page_is_first_page() {
        let mut a = PageBitmapAllocator::new(KIB, &[8 * KIB]).unwrap();
        assert_eq!(a.allocate(1), Some(locs(&[(0, 0)])));
        assert_eq!(a.used_bytes(), KIB);
        assert_eq!(a.available_bytes(), 7 * KIB);
        assert!(!a.is_free(loc(0, 0)));
        assert!(a.is_free(loc(0, 1)));
    }

    #[test]
    fn strategy1_contiguous_in_one_buffer() {
        let mut a = PageBitmapAllocator::new(KIB, &[8 * KIB]).unwrap();
        assert_eq!(a.allocate(3), Some(locs(&[(0, 0), (0, 1), (0, 2)])));
    }

    #[test]
    fn strategy1_skips_holes_too_small_and_buffers_too_full() {
        // Buffer 0: 4 pages, buffer 1: 8 pages. Fill buffer 0 except pages 1 and 3.
        let mut a = PageBitmapAllocator::new(KIB, &[4 * KIB, 8 * KIB]).unwrap();
        a.allocate(4).unwrap();
        a.deallocate(&locs(&[(0, 1), (0, 3)]));
        // A 2-page run exists only in buffer 1.
        assert_eq!(a.allocate(2), Some(locs(&[(1, 0), (1, 1)])));
        // A single page takes the first hole in buffer 0.
        assert_eq!(a.allocate(1), Some(locs(&[(0, 1)])));
    }

    #[test]
    fn strategy1_run_crossing_words() {
        let mut a = PageBitmapAllocator::new(KIB, &[256 * KIB]).unwrap();
        let all = a.allocate(256).unwrap();
        // Free 60..140: a run crossing two word boundaries; and a short hole at 10..20.
        let hole: Vec<_> = all[10..20].to_vec();
        let run: Vec<_> = all[60..140].to_vec();
        a.deallocate(&hole);
        a.deallocate(&run);
        let got = a.allocate(70).unwrap();
        assert_eq!(got, all[60..130].to_vec());
        assert_eq!(a.allocate(10), Some(hole));
    }

    #[test]
    fn strategy2_discrete_pages_in_one_buffer() {
        let mut a = PageBitmapAllocator::new(KIB, &[6 * KIB, 6 * KIB]).unwrap();
        let all = a.allocate(12).unwrap();
        // Free pages 1, 3, 5 of buffer 0 and 0, 2 of buffer 1: no run of 3 anywhere.
        a.deallocate(&locs(&[(0, 1), (0, 3), (0, 5), (1, 0), (1, 2)]));
        assert_eq!(all.len(), 12);
        assert_eq!(a.allocate(3), Some(locs(&[(0, 1), (0, 3), (0, 5)])));
        assert_eq!(a.free_pages(), 2);
    }

    #[test]
    fn strategy3_scatters_across_buffers() {
        let mut a = PageBitmapAllocator::new(KIB, &[2 * KIB, 2 * KIB]).unwrap();
        assert_eq!(a.allocate(3), Some(locs(&[(0, 0), (0, 1), (1, 0)])));
        assert_eq!(a.free_pages(), 1);
    }

    #[test]
    fn strategy3_takes_lowest_free_of_each_buffer_in_order() {
        let mut a = PageBitmapAllocator::new(KIB, &[4 * KIB, 4 * KIB, 4 * KIB]).unwrap();
        a.allocate(12).unwrap();
        a.deallocate(&locs(&[(2, 3), (0, 2), (1, 1), (1, 3), (2, 0)]));
        assert_eq!(a.allocate(4), Some(locs(&[(0, 2), (1, 1), (1, 3), (2, 0)])));
        assert_eq!(a.free_pages(), 1);
        assert!(a.is_free(loc(2, 3)));
    }

    #[test]
    fn fails_when_total_capacity_insufficient() {
        let mut a = PageBitmapAllocator::new(KIB, &[2 * KIB, 2 * KIB]).unwrap();
        let before = a.state();
        assert_eq!(a.allocate(5), None);
        assert_eq!(a.state(), before);
    }

    #[test]
    fn all_or_nothing_partial_fit_fails() {
        let mut a = PageBitmapAllocator::new(KIB, &[2 * KIB, 2 * KIB]).unwrap();
        a.allocate(2).unwrap();
        let before = a.state();
        assert_eq!(a.allocate(3), None);
        assert_eq!(a.state(), before);
        assert_eq!(a.available_bytes(), 2 * KIB);
    }

    #[test]
    fn deallocate_roundtrip_reallocates_same_set() {
        let mut a = PageBitmapAllocator::new(KIB, &[3 * KIB, 3 * KIB]).unwrap();
        let pages = a.allocate(5).unwrap();
        assert_eq!(pages, locs(&[(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]));
        a.deallocate(&pages);
        assert_eq!(a.free_pages(), 6);
        assert_eq!(a.used_bytes(), 0);
        assert_eq!(a.allocate(5), Some(pages));
    }

    #[test]
    fn deallocate_is_idempotent() {
        let mut a = PageBitmapAllocator::new(KIB, &[4 * KIB]).unwrap();
        let pages = a.allocate(2).unwrap();
        a.deallocate(&pages);
        a.deallocate(&pages);
        assert_eq!(a.free_pages(), 4);
        assert_eq!(a.used_bytes(), 0);
        assert!(pages.iter().all(|&p| a.is_free(p)));
    }

    #[test]
    fn deallocate_skips_bad_indexes() {
        let mut a = PageBitmapAllocator::new(KIB, &[4 * KIB]).unwrap();
        a.allocate(1).unwrap();
        let before = a.state();
        a.deallocate(&locs(&[(1, 0), (0, 4), (0, 3), (u32::MAX, u32::MAX)]));
        assert_eq!(a.state(), before);
        assert_eq!(a.free_pages(), 3);
        assert!(!a.is_free(loc(5, 0)));
    }

    #[test]
    fn exhaustion_then_exactly_the_freed_page_is_reused() {
        let mut a = PageBitmapAllocator::new(KIB, &[4 * KIB, 4 * KIB]).unwrap();
        a.allocate(8).unwrap();
        assert_eq!(a.allocate(1), None);
        a.deallocate(&locs(&[(1, 2)]));
        assert_eq!(a.allocate(1), Some(locs(&[(1, 2)])));
        assert_eq!(a.allocate(1), None);
    }

    #[test]
    fn byte_accounting() {
        let mut a = PageBitmapAllocator::new(KIB, &[10 * KIB + 1, 6 * KIB]).unwrap();
        assert_eq!(a.total_bytes(), 16 * KIB);
        let p = a.allocate(7).unwrap();
        assert_eq!((a.used_bytes(), a.available_bytes()), (7 * KIB, 9 * KIB));
        a.deallocate(&p[..3]);
        assert_eq!((a.used_bytes(), a.available_bytes()), (4 * KIB, 12 * KIB));
        assert_eq!(a.used_bytes() + a.available_bytes(), a.total_bytes());
    }

    #[test]
    fn a_free_that_joins_runs_makes_a_contiguous_fit_possible_again() {
        let mut a = PageBitmapAllocator::new(KIB, &[4 * KIB, 4 * KIB]).unwrap();
        a.allocate(8).unwrap();
        a.deallocate(&locs(&[(0, 0), (0, 2), (1, 0), (1, 2)]));
        // No run of 2 anywhere: strategy 2 takes buffer 0's free pages.
        assert_eq!(a.allocate(2), Some(locs(&[(0, 0), (0, 2)])));
        a.deallocate(&locs(&[(0, 0), (0, 1)]));
        // The free joined a run in buffer 0, which must be found again.
        assert_eq!(a.allocate(2), Some(locs(&[(0, 0), (0, 1)])));
    }

    #[test]
    fn run_tree_tracks_runs_across_words() {
        let mut a = PageBitmapAllocator::new(KIB, &[200 * KIB]).unwrap();
        let all = a.allocate(200).unwrap();
        assert_eq!(a.buffers[0].longest_run(), 0);
        // Free 60..140 (crossing words 0-1-2) and 150..152.
        a.deallocate(&all[60..140]);
        a.deallocate(&all[150..152]);
        assert_eq!(a.buffers[0].longest_run(), 80);
        assert!(a.consistent());
        assert_eq!(a.allocate(81).map(|p| p[0]), Some(loc(0, 60)), "strategy 2, no run of 81");
        a.deallocate(&all);
        assert_eq!(a.buffers[0].longest_run(), 200, "the tail padding stops the run at the last page");
        assert!(a.consistent());
    }

    #[test]
    fn fragmented_buffer_is_rejected_quickly_but_a_joined_run_is_found() {
        let mut a = PageBitmapAllocator::new(KIB, &[1024 * KIB]).unwrap();
        let all = a.allocate(1024).unwrap();
        // Runs of 3: every 4th page stays used.
        let free: Vec<_> = all.iter().copied().filter(|p| p.page_index % 4 != 0).collect();
        a.deallocate(&free);
        assert_eq!(a.buffers[0].longest_run(), 3);
        // No run of 4: strategy 2 takes the lowest four free pages.
        assert_eq!(a.allocate(4), Some(locs(&[(0, 1), (0, 2), (0, 3), (0, 5)])));
        a.deallocate(&locs(&[(0, 1), (0, 2), (0, 3), (0, 5)]));
        assert_eq!(a.buffers[0].longest_run(), 3);
        // Freeing page 512 joins 509..=515 into a run of 7, which must be found.
        a.deallocate(&locs(&[(0, 512)]));
        assert_eq!(a.buffers[0].longest_run(), 7);
        assert_eq!(a.allocate(5), Some((509..514).map(|p| loc(0, p)).collect()));
        assert!(a.consistent());
    }

    #[test]
    fn longest_run_in_word_cases() {
        assert_eq!(longest_run_in_word(0), 0);
        assert_eq!(longest_run_in_word(FULL), 64);
        assert_eq!(longest_run_in_word(FULL << 1), 63);
        assert_eq!(longest_run_in_word(0b1110_1100), 3);
        assert_eq!(longest_run_in_word(1 << 63 | 0b11), 2);
    }

    #[test]
    fn first_run_in_word_finds_lowest() {
        assert_eq!(first_run_in_word(0b1110_1100, 2), Some(2));
        assert_eq!(first_run_in_word(0b1110_1100, 3), Some(5));
        assert_eq!(first_run_in_word(0b1110_1100, 4), None);
        assert_eq!(first_run_in_word(FULL << 1, 63), Some(1));
        assert_eq!(first_run_in_word(FULL << 2, 63), None);
    }

    /// The reference allocator, written as plainly as possible: one `bool` per page.
    #[derive(Debug, Clone)]
    struct Model {
        used: Vec<Vec<bool>>,
    }

    impl Model {
        fn new(page_size: u64, sizes: &[u64]) -> Self {
            Self { used: sizes.iter().map(|&s| vec![false; (s / page_size) as usize]).collect() }
        }

        fn free_in(&self, b: usize) -> usize {
            self.used[b].iter().filter(|&&u| !u).count()
        }

        fn lowest_free(&self, b: usize, k: usize) -> Vec<PageLocation> {
            (0..self.used[b].len()).filter(|&p| !self.used[b][p]).take(k).map(|p| loc(b as u32, p as u32)).collect()
        }

        fn allocate(&mut self, n: usize) -> Option<Vec<PageLocation>> {
            if n == 0 {
                return None;
            }
            let chosen = self.choose(n)?;
            for p in &chosen {
                self.used[p.buffer_index as usize][p.page_index as usize] = true;
            }
            Some(chosen)
        }

        fn choose(&self, n: usize) -> Option<Vec<PageLocation>> {
            for b in 0..self.used.len() {
                if self.free_in(b) < n {
                    continue;
                }
                let pages = &self.used[b];
                if let Some(start) = (0..=pages.len() - n).find(|&s| pages[s..s + n].iter().all(|&u| !u)) {
                    return Some((start..start + n).map(|p| loc(b as u32, p as u32)).collect());
                }
            }
            if let Some(b) = (0..self.used.len()).find(|&b| self.free_in(b) >= n) {
                return Some(self.lowest_free(b, n));
            }
            let total: usize = (0..self.used.len()).map(|b| self.free_in(b)).sum();
            if total < n {
                return None;
            }
            let mut out = Vec::new();
            for b in 0..self.used.len() {
                let take = (n - out.len()).min(self.free_in(b));
                out.extend(self.lowest_free(b, take));
            }
            Some(out)
        }

        fn deallocate(&mut self, pages: &[PageLocation]) {
            for p in pages {
                if let Some(slot) =
                    self.used.get_mut(p.buffer_index as usize).and_then(|b| b.get_mut(p.page_index as usize))
                {
                    *slot = false;
                }
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Allocate(u64),
        /// Free the live allocation at this index (modulo the live count).
        Free(usize),
        /// Free one page of a live allocation (partial frees fragment buffers).
        FreeOne(usize, usize),
        /// Free an arbitrary location, possibly out of range or already free.
        FreeRaw(u32, u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => (1u64..40).prop_map(Op::Allocate),
            1 => (1u64..300).prop_map(Op::Allocate),
            3 => any::<usize>().prop_map(Op::Free),
            2 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Op::FreeOne(a, b)),
            1 => (0u32..5, 0u32..300).prop_map(|(b, p)| Op::FreeRaw(b, p)),
        ]
    }

    /// Buffer sizes in pages (0 to ~3 words, odd sizes to exercise the padding bits).
    fn sizes() -> impl Strategy<Value = Vec<u64>> {
        prop::collection::vec(0u64..200, 0..5)
    }

    fn pick<T>(v: &[T], i: usize) -> Option<usize> {
        (!v.is_empty()).then(|| i % v.len())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Never hands out a live page twice; frees restore capacity exactly; failures change nothing;
        /// a success is exactly `n` distinct in-range pages.
        #[test]
        fn allocator_invariants(page_sizes in sizes(), ops in prop::collection::vec(op(), 1..120)) {
            let page_size = 512;
            let byte_sizes: Vec<u64> = page_sizes.iter().map(|&p| p * page_size + p % 3).collect();
            let mut a = PageBitmapAllocator::new(page_size, &byte_sizes).unwrap();
            let mut live: Vec<Vec<PageLocation>> = Vec::new();
            let mut live_set: HashSet<PageLocation> = HashSet::new();
            for op in ops {
                match op {
                    Op::Allocate(n) => {
                        let before = a.state();
                        let free_before = a.free_pages();
                        match a.allocate(n) {
                            Some(pages) => {
                                prop_assert_eq!(pages.len() as u64, n);
                                for &p in &pages {
                                    prop_assert!(u64::from(p.page_index) < a.buffer_pages(p.buffer_index as usize));
                                    prop_assert!(!a.is_free(p));
                                    prop_assert!(live_set.insert(p), "page {:?} handed out twice", p);
                                }
                                prop_assert_eq!(a.free_pages(), free_before - n);
                                live.push(pages);
                            }
                            None => prop_assert_eq!(a.state(), before),
                        }
                    }
                    Op::Free(i) => {
                        if let Some(i) = pick(&live, i) {
                            let pages = live.swap_remove(i);
                            let free_before = a.free_pages();
                            a.deallocate(&pages);
                            prop_assert_eq!(a.free_pages(), free_before + pages.len() as u64);
                            for p in &pages {
                                live_set.remove(p);
                                prop_assert!(a.is_free(*p));
                            }
                        }
                    }
                    Op::FreeOne(i, j) => {
                        if let Some(i) = pick(&live, i) {
                            let j = j % live[i].len();
                            let p = live[i].swap_remove(j);
                            if live[i].is_empty() {
                                live.swap_remove(i);
                            }
                            live_set.remove(&p);
                            let free_before = a.free_pages();
                            a.deallocate(&[p]);
                            prop_assert_eq!(a.free_pages(), free_before + 1);
                        }
                    }
                    Op::FreeRaw(b, p) => {
                        let p = loc(b, p);
                        if !live_set.contains(&p) {
                            let before = a.state();
                            a.deallocate(&[p]);
                            prop_assert_eq!(a.state(), before, "freeing a page nobody holds changed state");
                        }
                    }
                }
                prop_assert!(a.consistent(), "run tree, hint or counters out of sync with the bitmap");
                prop_assert_eq!(a.free_pages() + live_set.len() as u64, a.total_pages());
                prop_assert_eq!(a.used_bytes() + a.available_bytes(), a.total_bytes());
            }
            // Freeing everything restores full capacity, and a full-size allocation then succeeds.
            for pages in &live {
                a.deallocate(pages);
            }
            prop_assert_eq!(a.free_pages(), a.total_pages());
            if a.total_pages() > 0 {
                prop_assert_eq!(a.allocate(a.total_pages()).map(|p| p.len() as u64), Some(a.total_pages()));
            }
        }

        /// Chooses exactly the pages the plain `Vec<bool>` model chooses.
        #[test]
        fn allocator_matches_model(page_sizes in sizes(), ops in prop::collection::vec(op(), 1..120)) {
            check_against_model(&page_sizes, ops)?;
        }

        /// The same on buffers of up to ~40 words, so run searches descend deeper trees.
        #[test]
        fn allocator_matches_model_on_larger_buffers(
            page_sizes in prop::collection::vec(0u64..2600, 1..4),
            ops in prop::collection::vec(big_op(), 1..200),
        ) {
            check_against_model(&page_sizes, ops)?;
        }
    }

    fn big_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u64..100).prop_map(Op::Allocate),
            1 => (1u64..1500).prop_map(Op::Allocate),
            3 => any::<usize>().prop_map(Op::Free),
            3 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Op::FreeOne(a, b)),
        ]
    }

    fn check_against_model(page_sizes: &[u64], ops: Vec<Op>) -> Result<(), TestCaseError> {
        let page_size = 64;
        let byte_sizes: Vec<u64> = page_sizes.iter().map(|&p| p * page_size).collect();
        let mut a = PageBitmapAllocator::new(page_size, &byte_sizes).unwrap();
        let mut m = Model::new(page_size, &byte_sizes);
        let mut live: Vec<Vec<PageLocation>> = Vec::new();
        for op in ops {
            match op {
                Op::Allocate(n) => {
                    let got = a.allocate(n);
                    prop_assert_eq!(&got, &m.allocate(n as usize));
                    live.extend(got);
                }
                Op::Free(i) => {
                    if let Some(i) = pick(&live, i) {
                        let pages = live.swap_remove(i);
                        a.deallocate(&pages);
                        m.deallocate(&pages);
                    }
                }
                Op::FreeOne(i, j) => {
                    if let Some(i) = pick(&live, i) {
                        let j = j % live[i].len();
                        let p = live[i].swap_remove(j);
                        if live[i].is_empty() {
                            live.swap_remove(i);
                        }
                        a.deallocate(&[p]);
                        m.deallocate(&[p]);
                    }
                }
                Op::FreeRaw(b, p) => {
                    // Only out-of-range frees here: freeing someone's live page would desync `live`.
                    let p = loc(b, p);
                    if !a.is_free(p) && a.buffer_pages(b as usize) > u64::from(p.page_index) {
                        continue;
                    }
                    a.deallocate(&[p]);
                    m.deallocate(&[p]);
                }
            }
            for (b, pages) in m.used.iter().enumerate() {
                for (i, &used) in pages.iter().enumerate() {
                    prop_assert_eq!(a.is_free(loc(b as u32, i as u32)), !used);
                }
            }
        }
        prop_assert!(a.consistent());
        Ok(())
    }
}
