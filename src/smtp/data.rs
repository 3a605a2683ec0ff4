//! The message after `DATA`: lines unstuffed (a leading dot removed) up to
//! the end of data, `CR LF . CR LF` and nothing else (RFC 5321 4.1.1.4).
//! A bare LF never starts a line, and a dot line ends the data only when
//! exactly CR LF follows the dot: `CR LF . CR CR LF` is data. A relay in
//! front of sluice that reads such a line as data while sluice read it as
//! the end would let the rest of the message be taken for commands (SMTP
//! smuggling); smtp-proto's receiver accepts any run of CRs there.

/// Where the reader is in the byte stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    /// At the start of a line.
    LineStart,
    /// Inside a line.
    Mid,
    /// Just after a CR inside a line.
    Cr,
    /// After the dot that starts a line (taken off).
    Dot,
    /// After a line's leading dot and a CR.
    DotCr,
    /// The end of data was read.
    Done,
}

/// Reads one message's data, in as many pieces as it comes.
#[derive(Debug)]
pub struct DataReader {
    at: At,
}

impl DataReader {
    pub fn new() -> DataReader {
        DataReader { at: At::LineStart }
    }

    /// Take what `input` holds of the data, appending it unstuffed to
    /// `sink` (none: discarded). Returns how many bytes were used: all of
    /// them until the end of data, whose last byte is the last one used
    /// (what follows is the next command). The message keeps the line end
    /// before the final dot.
    pub fn ingest(&mut self, input: &[u8], mut sink: Option<&mut Vec<u8>>) -> usize {
        let mut push = |bytes: &[u8]| {
            if let Some(s) = sink.as_deref_mut() {
                s.extend_from_slice(bytes);
            }
        };
        let mut i = 0;
        while i < input.len() {
            let b = input[i];
            match self.at {
                At::Done => return i,
                At::Mid => {
                    // The rest of the line, up to a CR, at once.
                    let run = input[i..].iter().position(|&c| c == b'\r');
                    let end = run.map_or(input.len(), |p| i + p);
                    push(&input[i..end]);
                    if end < input.len() {
                        push(b"\r");
                        self.at = At::Cr;
                        i = end + 1;
                    } else {
                        i = end;
                    }
                    continue;
                }
                At::Cr => {
                    push(&[b]);
                    self.at = match b {
                        b'\n' => At::LineStart,
                        b'\r' => At::Cr,
                        _ => At::Mid,
                    };
                }
                At::LineStart => {
                    if b == b'.' {
                        self.at = At::Dot;
                    } else {
                        // Not consumed: read as the line's first byte.
                        self.at = At::Mid;
                        continue;
                    }
                }
                At::Dot => {
                    if b == b'\r' {
                        self.at = At::DotCr;
                    } else {
                        self.at = At::Mid;
                        continue;
                    }
                }
                At::DotCr => {
                    if b == b'\n' {
                        self.at = At::Done;
                    } else {
                        // A line `.` CR then more: data, the dot taken off.
                        push(b"\r");
                        self.at = At::Cr;
                        continue;
                    }
                }
            }
            i += 1;
        }
        input.len()
    }

    /// Whether the end of data was read.
    pub fn done(&self) -> bool {
        self.at == At::Done
    }
}

#[cfg(test)]
mod tests {
    use super::DataReader;

    /// The message read from `input` in pieces of `step` bytes, the bytes
    /// left after the end of data, and whether it ended.
    fn read(input: &[u8], step: usize) -> (Vec<u8>, Vec<u8>, bool) {
        let mut r = DataReader::new();
        let mut out = Vec::new();
        let mut at = 0;
        while at < input.len() && !r.done() {
            let end = (at + step).min(input.len());
            at += r.ingest(&input[at..end], Some(&mut out));
        }
        (out, input[at..].to_vec(), r.done())
    }

    /// Input, the message read from it, what is left after it, whether
    /// the end of data came.
    type Case = (&'static [u8], &'static [u8], &'static [u8], bool);

    #[test]
    fn the_end_of_data_is_crlf_dot_crlf_and_nothing_else() {
        for step in [1, 2, 3, 7, 1000] {
            let cases: &[Case] = &[
                (b".\r\n", b"", b"", true),
                (b"a\r\n.\r\nNOOP\r\n", b"a\r\n", b"NOOP\r\n", true),
                (b"..dot\r\n.\r\n", b".dot\r\n", b"", true),
                (b".x\r\n.\r\n", b"x\r\n", b"", true),
                // A bare LF starts no line: no end, no unstuffing.
                (b"a\n.\nb\r\n.\r\n", b"a\n.\nb\r\n", b"", true),
                // CR runs after the dot are data (smtp-proto ended here).
                (b"a\r\n.\r\r\nb\r\n.\r\n", b"a\r\n\r\r\nb\r\n", b"", true),
                (b"a\r\n.\rb\r\n.\r\n", b"a\r\n\rb\r\n", b"", true),
                (b"a\r\r\n.\r\n", b"a\r\r\n", b"", true),
                (b"a\r\n.", b"a\r\n", b"", false),
                (b"a\r\nb", b"a\r\nb", b"", false),
            ];
            for &(input, message, rest, ended) in cases {
                let (m, r, done) = read(input, step);
                let shown = String::from_utf8_lossy(input);
                assert_eq!(m, message, "{shown:?} in steps of {step}");
                assert_eq!(r, rest, "{shown:?} in steps of {step}");
                assert_eq!(done, ended, "{shown:?} in steps of {step}");
            }
        }
    }

    #[test]
    fn discarding_finds_the_same_end() {
        let mut r = DataReader::new();
        let input = b"x\r\n.\r\r\ny\r\n.\r\nQUIT\r\n";
        let used = r.ingest(input, None);
        assert!(r.done());
        assert_eq!(&input[used..], b"QUIT\r\n");
    }
}
