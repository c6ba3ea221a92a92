//! The names of a consumer's queues: the work queue the user names, and
//! beside it the retry queue and the dead-letter queue. One definition for
//! the consumer (which declares and publishes to them) and the relay's
//! console (which reads, replays and purges them).

/// The retry queue of work queue `queue`.
pub fn retry_queue(queue: &str) -> String {
    format!("{queue}.retry")
}

/// The dead-letter queue of work queue `queue`.
pub fn dead_letter_queue(queue: &str) -> String {
    format!("{queue}.dlq")
}

/// The headers RabbitMQ adds to a message it dead-letters: its death
/// history. A message the consumer dead-letters itself, or an operator
/// replays, carries none of them (RabbitMQ could take an old history for
/// a cycle and drop the message).
pub const DEATH_HISTORY: &[&str] = &[
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
];

/// The longest a work queue's name may be so that its retry queue's name
/// still fits AMQP's 255 bytes.
pub const MAX_WORK_QUEUE_LEN: usize = 255 - ".retry".len();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queues_sit_beside_the_work_queue() {
        assert_eq!(retry_queue("billing"), "billing.retry");
        assert_eq!(dead_letter_queue("billing"), "billing.dlq");
        assert_eq!(retry_queue(&"q".repeat(MAX_WORK_QUEUE_LEN)).len(), 255);
    }
}
